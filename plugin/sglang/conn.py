"""dsa-bridge as sglang's PD transfer: the classes sglang's ``get_kv_class`` hands out for the
``mooncake`` and ``nixl`` backends (``hooks.py``), and the bootstrap server.

Imported only where ``sglang`` is installed. The classes implement
``sglang.srt.disaggregation.base.conn`` as sglang 0.5.23's scheduler queues call them, over
dsa-bridge's ``PrefillNode`` / ``DecodeNode`` (layer-id pairing, bounds checks before any write,
deadlines, KVPoll states), one role per module:

- ``DSABridgeKVManager`` (``manager.py``): one per scheduler rank; bring-up, the prefill's
  registration, the memory saver, and its parts: the prefill stages' consensus
  (``stage_consensus.py``), decode's nodes (``decode_nodes.py``), sglang's deferred release
  (``deferred_release.py``);
- ``DSABridgeKVSender`` (``sender.py``): one request on a prefill rank;
- ``DSABridgeKVReceiver`` (``receiver.py``): one request on a decode rank;
- ``failures.py``: how a request ends in sglang's terms;
- ``DSABridgeKVBootstrapServer`` (here): sglang's own HTTP registry (``CommonKVBootstrapServer``,
  the routes its decode calls), so prefill ranks of either connector register there.

The pure decisions of bring-up are in ``bringup.py``, the buffers as a node's pool in
``paged_buffers.py``, sglang's deadline per phase of a request in ``phases.py``, a mixed
deployment's refusal and detection in ``mixed.py``.

sglang fails a request on every TP rank once one rank's poll failed (it MIN-reduces the polls),
then calls ``failure_exception()`` on each and frees the pages: on a rank whose own transfer had
not failed, the sender's and the receiver's ``failure_exception()`` stop it first (the receiver's
abort holds its pages in the fence until no write can land), raising ``is_from_another_rank``.

Senders and receivers built over a sglang manager (the non-DSA fallback) are sglang's own.
Limits (refused with a message naming the flag to change, see docs/sglang.md): attention-TP
widths that divide each other, attention CP on prefill only (CP rank 0 writes and the other CP
ranks are dummy senders, or with layer split each writes its layers, or with a page split each
its share of the pages: ``bringup.cp_problems``), KV sharding on prefill (each rank of the shard
group its shard of the pages: ``bringup.PageShare``; without CP at equal attention-TP widths),
decode pipeline stages 1 or the prefill's
(prefill DP ranks are registered for decode's query where it cannot compute them:
``dp_route``), device destinations only, decode radix-cache prefixes of whole pages (as sglang's
radix cache makes them).
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from .manager import DSABridgeKVManager
from .mixed import ForeignDecodes, foreign_route_query
from .receiver import DSABridgeKVReceiver
from .sender import DSABridgeKVSender

log = logging.getLogger(__name__)


class DSABridgeKVBootstrapServer(CommonKVBootstrapServer):
    """sglang's HTTP bootstrap registry, unchanged: dsa-bridge's prefill ranks register their
    control endpoints there (``PUT /route``) and its decode ranks look them up (``GET
    /route``) exactly as sglang's own connectors do, so either connector's ranks can use it.
    A parallel-info query of a decode running sglang's own connector is counted
    (``foreign_decodes``) and logged once per host, saying which side lacks the plugin
    (``mixed.py``)."""

    def __init__(self, *args, **kwargs):
        self.foreign_decodes = ForeignDecodes()
        super().__init__(*args, **kwargs)  # starts serving

    async def _handle_route_get(self, request):
        if foreign_route_query(request.query):
            reason = self.foreign_decodes.record(request.remote or "?")
            if reason is not None:
                log.error("dsa-bridge: %s", reason)
        return await super()._handle_route_get(request)


# what sglang's ``get_kv_class`` hands out for a bridged backend, by sglang's ``KVClassType``
CLASSES = {
    "manager": DSABridgeKVManager,
    "sender": DSABridgeKVSender,
    "receiver": DSABridgeKVReceiver,
    "bootstrap_server": DSABridgeKVBootstrapServer,
}
