"""What the connector's scheduler side tells its workers in one step: ``BridgeMetadata``.

- ``sends`` (prefill): requests that finished with their KV held (``request_finished``
  returned delay-free): the room and the blocks whose pages the worker writes to the decode
  that announces the room;
- ``loads`` (decode): requests whose blocks vLLM just allocated (``update_state_after_alloc``):
  the prefill's answer and the blocks the worker announces to it;
- ``aborts`` (decode): loading requests vLLM finished meanwhile (aborted): the worker aborts
  them and reports them finished only once no write into their blocks can still land.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .options import PrefillAnswer


@dataclass(frozen=True)
class Send:
    room: int
    block_ids: tuple[int, ...]  # the prompt's blocks, in order


@dataclass(frozen=True)
class Load:
    answer: PrefillAnswer
    block_ids: tuple[int, ...]  # decode's blocks for the prompt after ``prefix_tokens``
    prefix_tokens: int  # the prompt's first tokens decode computed itself (whole blocks)


@dataclass
class BridgeMetadata(KVConnectorMetadata):
    sends: dict[str, Send] = field(default_factory=dict)
    loads: dict[str, Load] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)
