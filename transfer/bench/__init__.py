"""dsa_bridge.transfer.bench: ``dsa-bridge bench``, a tool over the transfer core.

``command`` is the subcommand and its report, ``measure`` the measurements, ``child`` the
prefill process they drive, ``channel`` the command channel to such processes; ``sglang_pd``
the section against sglang's own connector, and ``sglang_rank`` the rank processes it starts
(sglang imported there only).
"""
