"""What the connector reads, pure: its extra config (``BridgeOptions``), a prefill's answer in a
request's ``kv_transfer_params`` (``PrefillAnswer``), a worker's TP rank (``tp_position``) and
which prefill ranks a decode rank reads from (``SourceRanks``).

Every bad value is refused with one line naming the key; nothing here touches a socket, a thread
or a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BACKENDS = ("mooncake", "nixl")
MAX_ROOM = 2**63 - 1
MAX_PORT = 65535
_DEFAULTS: dict[str, Any] = {
    "engine": "mooncake",  # the transfer engine: mooncake or nixl
    "checksums": False,  # end-to-end page checksums (both sides must agree)
    "host": "127.0.0.1",  # the host the prefill's control endpoints listen on and announce
    "port": 0,  # a prefill's first control port: TP rank r listens on port + r (required there)
    "request_timeout_s": 60.0,  # a request not written by then fails (both sides)
    "handshake_timeout_s": 10.0,  # decode's handshake with a prefill it has not met yet
    "peer_timeout_s": 5.0,  # a peer silent this long is taken for dead
    "num_threads": None,  # NIXL's UCX worker threads (vLLM's NixlConnector reads this key too)
}


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class BridgeOptions:
    """The connector's settings, from ``kv_connector_extra_config`` (``parse``)."""

    engine: str = "mooncake"
    checksums: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    request_timeout_s: float = 60.0
    handshake_timeout_s: float = 10.0
    peer_timeout_s: float = 5.0
    num_threads: int | None = None  # None: dsa-bridge's default (transfer/backends/nixl.py)

    @staticmethod
    def parse(extra: dict[str, Any] | None, *, producer: bool) -> BridgeOptions:
        """``extra`` checked key by key; a producer (prefill) needs ``port``."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r} (dsa-bridge "
                             f"reads {sorted(_DEFAULTS)})")
        values = {**_DEFAULTS, **extra}
        if values["engine"] not in BACKENDS:
            raise ValueError(f"kv_connector_extra_config['engine'] must be one of {BACKENDS}, "
                             f"got {values['engine']!r}")
        if not isinstance(values["checksums"], bool):
            raise ValueError("kv_connector_extra_config['checksums'] must be true or false, got "
                             f"{values['checksums']!r}")
        if not isinstance(values["host"], str) or not values["host"]:
            raise ValueError(f"kv_connector_extra_config['host'] must be a host name or address, "
                             f"got {values['host']!r}")
        port = values["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
            raise ValueError(f"kv_connector_extra_config['port'] must be a port number, got {port!r}")
        if producer and port == 0:
            raise ValueError("kv_connector_extra_config['port'] is required on a prefill "
                             "(kv_producer / kv_both): TP rank r listens on port + r")
        timeouts = {key: _number(key, values[key])
                    for key in ("request_timeout_s", "handshake_timeout_s", "peer_timeout_s")}
        threads = values["num_threads"]
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
                raise ValueError("kv_connector_extra_config['num_threads'] must be a whole number "
                                 f">= 0, got {threads!r}")
            if values["engine"] != "nixl":
                raise ValueError("kv_connector_extra_config['num_threads'] is NIXL's (engine "
                                 f"'nixl'): engine {values['engine']!r} has no worker threads")
        return BridgeOptions(values["engine"], values["checksums"], values["host"], port,
                             **timeouts, num_threads=threads)

    def backend_options(self) -> dict[str, Any]:
        """What ``create_backend`` takes besides the engine and host: NIXL's UCX parameters where
        ``num_threads`` was given."""
        if self.num_threads is None:
            return {}
        return {"backend_params": {"num_threads": str(self.num_threads)}}

    def endpoint(self, rank: int) -> str:
        """The control endpoint prefill TP rank ``rank`` listens on."""
        if self.port + rank > MAX_PORT:
            raise ValueError(f"kv_connector_extra_config['port'] {self.port} + TP rank {rank} is "
                             "not a port")
        return f"{self.host}:{self.port + rank}"


@dataclass(frozen=True)
class PrefillAnswer:
    """Where a decode reads a request from: what a prefill's ``request_finished`` returned in
    its ``kv_transfer_params`` (``to_params``), passed on by the proxy to the decode."""

    room: int  # the request on the prefill's nodes
    host: str
    port: int  # prefill TP rank r's control endpoint: host:port + r
    tp_size: int
    num_tokens: int  # the prompt tokens prefill holds, whose pages it writes
    engine: str

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_room": self.room,
                "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
                "remote_num_tokens": self.num_tokens, "remote_engine": self.engine}

    @staticmethod
    def from_params(params: dict[str, Any]) -> PrefillAnswer:
        """The answer in a decode request's ``kv_transfer_params``; ValueError naming the key."""
        def field(key: str, kind: type, low: int = 0, high: int = MAX_ROOM):
            value = params.get(key)
            if value is None:
                raise ValueError(f"kv_transfer_params has no {key!r} (pass the prefill's "
                                 "kv_transfer_params on unchanged)")
            bad = isinstance(value, bool) or not isinstance(value, kind)
            if not bad and kind is int and not low <= value <= high:
                bad = True
            if bad or (kind is str and not value):
                raise ValueError(f"kv_transfer_params[{key!r}] is invalid: {value!r}")
            return value
        answer = PrefillAnswer(field("remote_room", int), field("remote_host", str),
                               field("remote_port", int, 1, MAX_PORT), field("tp_size", int, 1, 1024),
                               field("remote_num_tokens", int, 1), field("remote_engine", str))
        if answer.port + answer.tp_size - 1 > MAX_PORT:
            raise ValueError(f"kv_transfer_params: ports {answer.port}..+{answer.tp_size - 1} "
                             "are not ports")
        return answer

    def endpoint(self, rank: int) -> str:
        return f"{self.host}:{self.port + rank}"


@dataclass(frozen=True)
class SourceRanks:
    """The prefill TP ranks a decode TP rank talks to: the MLA cache is replicated on every
    rank, so one ``source`` rank writes it; ``idle`` ranks (a prefill wider than decode) are told
    they have nothing to send; ``copies``: how many decode ranks ``source`` writes (a decode
    wider than prefill)."""

    source: int
    idle: tuple[int, ...]
    copies: int

    @staticmethod
    def of(decode_rank: int, decode_size: int, prefill_size: int) -> SourceRanks:
        """ValueError where neither width divides the other."""
        wide, narrow = max(decode_size, prefill_size), min(decode_size, prefill_size)
        if wide % narrow:
            raise ValueError(f"TP widths: prefill {prefill_size}, decode {decode_size}: neither is "
                             "a multiple of the other (give the servers TP sizes that divide "
                             "each other)")
        if decode_size >= prefill_size:
            copies = decode_size // prefill_size
            return SourceRanks(decode_rank // copies, (), copies)
        group = prefill_size // decode_size
        first = decode_rank * group
        return SourceRanks(first, tuple(range(first + 1, first + group)), 1)


def tp_position(state: tuple[int, int] | None, configured_size: int) -> tuple[int, int]:
    """This worker's (TP rank, TP size): vLLM's parallel state where it is initialised (each of
    the executor's workers, its own rank), else rank 0 of the configured
    ``tensor_parallel_size``. ValueError where the two disagree."""
    if state is None:
        return 0, configured_size
    rank, size = state
    if size != configured_size or not 0 <= rank < size:
        raise ValueError(f"vLLM's parallel state makes this worker TP rank {rank} of {size}, but "
                         f"its config has tensor_parallel_size {configured_size}")
    return rank, size


def pages_of(num_tokens: int, page_size: int) -> int:
    """Pages holding ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)
