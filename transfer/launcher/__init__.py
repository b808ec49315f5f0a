"""dsa_bridge.transfer.launcher: the ``dsa-bridge`` command, a tool over the transfer core.

``cli`` parses and dispatches, ``options`` validates every option, ``drivers`` runs the prefill
and decode roles with a stand-in model (``page_pattern``, ``page_allocator``), ``demo`` runs both
as processes, ``summary`` writes and prints what a run did.
"""
