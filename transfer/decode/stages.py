"""Which prefill nodes feed a decode request, pure: chosen by endpoint, checked once per choice.

A request is fed by one prefill node, or by the pipeline stages that together hold each of
decode's layers exactly once (``handshake.check_stages``: ValueError naming the layer otherwise),
or by share writers that each hold every layer (``handshake.check_shares``).
Without a choice it is the first prefill node that holds every layer, else all of them. The peers
and their layouts are fixed for the node's life (a prefill that comes back with another layout is
refused), so each choice is checked once and remembered. A layer of decode's that none of them
holds fails the handshake (HandshakeError), before any request.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...plugin.layout import DSALayout
from ..handshake import HandshakeError, check_shares, check_stages
from .sessions import PrefillPeer

Choice = str | Sequence[str] | None


class StageChoice:
    """The peers of a request, from the prefill endpoint(s) the application names."""

    def __init__(self, layout: DSALayout, peers: Sequence[PrefillPeer]):
        held = {lid for peer in peers for lid in peer.layout.layer_ids}
        missing = [lid for lid in layout.layer_ids if lid not in held]
        if missing:
            raise HandshakeError(f"layer sets: layer {missing[0]} is held by none of the prefill "
                                 f"nodes ({', '.join(p.endpoint for p in peers)})")
        self.layout = layout
        self.peers = peers
        self._checked: dict[tuple, list[PrefillPeer]] = {}

    def peers_for(self, prefill: Choice, *, shares: bool = False) -> list[PrefillPeer]:
        """The peers named (stages; with ``shares``, share writers), checked once."""
        key = (prefill if prefill is None or isinstance(prefill, str) else tuple(prefill), shares)
        try:
            peers = self._checked.get(key)
        except TypeError:  # an unhashable name: refused by the check, naming what was given
            return self._check(prefill, shares)
        if peers is None:
            peers = self._checked[key] = self._check(prefill, shares)
        return list(peers)

    def _check(self, prefill: Choice, shares: bool) -> list[PrefillPeer]:
        if prefill is None:
            whole = [p for p in self.peers if set(self.layout.layer_ids) <= set(p.layout.layer_ids)]
            peers = whole[:1] or list(self.peers)
        elif isinstance(prefill, str):
            peers = [self._peer(prefill)]
        else:
            peers = [self._peer(endpoint) for endpoint in prefill]
            if len({p.endpoint for p in peers}) != len(peers):
                raise ValueError(f"a prefill node is named twice: {list(prefill)}")
        named = [(p.endpoint, p.layout) for p in peers]
        if shares:
            check_shares(self.layout, named)
        else:
            check_stages(self.layout, named)
        return peers

    def _peer(self, endpoint: str) -> PrefillPeer:
        for peer in self.peers:
            if peer.endpoint == endpoint:
                return peer
        raise ValueError(f"not connected to prefill {endpoint}")
