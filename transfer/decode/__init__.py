"""dsa_bridge.transfer.decode: the decode node, which receives requests into its pool.

Read in this order: ``node`` (``DecodeNode``, the coordinator), ``sessions`` (the handshake
initiator and re-handshake state machine), ``stages`` (which prefill nodes feed a request),
``receiver`` (``KVReceiver``: one request, settling itself), ``fence`` (what each stage reported,
and who may still write), ``verify`` (the checksum verifier thread).
"""

from .node import DecodeNode
from .receiver import KVReceiver

__all__ = ["DecodeNode", "KVReceiver"]
