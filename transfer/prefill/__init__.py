"""dsa_bridge.transfer.prefill: the prefill node, which writes each request's pages into the decode
nodes that asked for them.

Read in this order: ``node`` (``PrefillNode``, the coordinator), ``records`` (``KVSender`` and the
plain records of peers, destinations and chunks), ``sessions`` (the handshake responder and the
sessions' fences), ``prefill_request`` (all the node knows of one request, in one object),
``requests`` (one such object per room, and the way of its chunks to the writer), ``writer`` (one
lane per decode engine peer), ``checksums`` and ``outcomes`` (what happens to a chunk after its
write).
"""

from .node import PrefillNode
from .records import IncomingRequest, KVSender

__all__ = ["IncomingRequest", "KVSender", "PrefillNode"]
