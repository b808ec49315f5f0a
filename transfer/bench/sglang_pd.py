"""The ``sglang`` section of ``dsa-bridge bench``: the same requests through sglang's own Mooncake
connector (``MooncakeKVManager``, ``MooncakeKVSender``, ``MooncakeKVReceiver``) and through
dsa-bridge's, both driven by the same sglang code on the same pools. (sglang's prefill writes a
request in three ``batch_transfer_sync_write`` calls — KV, the indexer through its
``maybe_send_extra``, aux — on the one transfer thread of the decode's queue; dsa-bridge's in
one engine write of all the requests queued for that decode.)

Where sglang is installed (``.venv-sglang``), four rank processes (``bench.sglang_rank``): a
prefill and a decode per connector, each as a scheduler process on the CPU builds it — sglang's
own DSA token-to-KV pool (DeepSeek-V3.2), ``MetadataBuffers`` and ``_init_kv_manager``; which
connector it gets is sglang's ``get_kv_class`` after its ``load_plugins()``, with
``SGLANG_PLUGINS=dsa_bridge`` or without. Mooncake over TCP on loopback for both.

The requests move in waves of ``in_flight`` requests, the two connectors' waves interleaved
(A B A B ...) so that the machine's load falls on both alike. A wave: decode's receivers are
made and send their pages (sglang's prealloc queue), prefill's senders see them (its bootstrap
queue) — then the timed window, from prefill's first ``send`` to the moment decode saw the last
request Success; then decode compares every request's KV, indexer and aux bytes with prefill's.
Each connector's first wave of a mode is a warm-up (its connections made, its pages touched):
checked, not counted.
Per connector and mode: ms per request, GB/s, each process's CPU seconds in the windows (also
per thread: decode's is mostly the engine's receiving copy); the ratio dsa-bridge / sglang is
the median, over wave pairs, of sglang's wave seconds over dsa-bridge's (above 1: dsa-bridge
faster).

This module does not import sglang: the bench process only drives the ranks.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from dataclasses import dataclass

from .channel import Driven

PAGE = 64  # tokens a page, the ranks' sglang --page-size
CONNECTORS = ("sglang", "dsa-bridge")
CONNECTOR_ENV = {"sglang": {}, "dsa-bridge": {"SGLANG_PLUGINS": "dsa_bridge"}}
RANK_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp",
            "MC_LOG_LEVEL": "ERROR"}
TARGET_RATIO = 1.0  # dsa-bridge / sglang's own, at every mode
START_TIMEOUT_S = 120.0  # a rank imports sglang: tens of seconds on a loaded 2-core host
COMMAND_TIMEOUT_S = 300.0
SEED = 19
ROOM_BASE = 2**40


@dataclass(frozen=True)
class Mode:
    """``requests`` requests of ``tokens`` tokens each, ``in_flight`` at a time. ``busy``: the
    ranks wait as sglang's scheduler loop does while a transfer is in flight (it never sleeps,
    and hands the GIL over once a pass with ``time.sleep(0)``: its ``on_idle`` in PD mode), not
    with 1 ms sleeps between polls; each process's CPU in the window is then mostly that loop's."""

    in_flight: int
    requests: int
    tokens: int
    busy: bool = False

    @property
    def name(self) -> str:
        return f"{self.in_flight} x {self.tokens}" + (", busy" if self.busy else "")

    @property
    def pages(self) -> int:
        return self.tokens // PAGE

    @property
    def waves(self) -> int:
        return self.requests // self.in_flight


@dataclass(frozen=True)
class PDSizes:
    layers: int  # DeepSeek-V3.2 cut to this many (61: the whole model)
    modes: tuple[Mode, ...]

    @property
    def pool_pages(self) -> int:
        """Pages the pools hold: the largest wave's, and the padding page."""
        return max(m.in_flight * m.pages for m in self.modes) + 1

    @property
    def slots(self) -> int:
        return max(m.in_flight for m in self.modes)


SGLANG_SIZES = {
    "full": PDSizes(layers=61, modes=(Mode(1, 16, 8192), Mode(8, 64, 2048),
                                      Mode(8, 32, 2048, busy=True))),
    "quick": PDSizes(layers=61, modes=(Mode(1, 8, 8192), Mode(8, 32, 2048),
                                       Mode(8, 16, 2048, busy=True))),
    "tiny": PDSizes(layers=4, modes=(Mode(1, 2, 256), Mode(2, 4, 128), Mode(2, 2, 128, busy=True))),
}


def sglang_problem() -> str | None:
    """Why the section cannot run in this interpreter (None: it can)."""
    if importlib.util.find_spec("sglang") is None:
        return (f"sglang is not importable from {sys.executable}: the sglang section runs "
                "where sglang is installed (.venv-sglang, see docs/sglang.md)")
    return None


def wave_requests(mode: Mode, wave: int) -> list[list[int]]:
    """A wave's requests as (bootstrap room, slot, pages): the same rooms on both connectors
    (wave -1: the warm-up)."""
    first = ROOM_BASE + 10**6 * mode.busy + 1000 * (wave + 1) + 100 * mode.in_flight
    return [[first + slot, slot, mode.pages] for slot in range(mode.in_flight)]


def summarize(waves: list[dict]) -> dict:
    """Per mode (``Mode.name``: ``"in_flight x tokens"``, then ``", busy"`` for a busy
    scheduler loop): each connector's ms per request (median over its waves), GB/s (all its
    bytes over all its windows), CPU seconds of each process summed over the windows, and the
    ratio dsa-bridge / sglang (median over wave pairs of sglang's seconds over dsa-bridge's)
    with whether it meets ``TARGET_RATIO``; each process's CPU seconds per thread name summed
    over the windows (``..._cpu_by_thread``), where the waves have them. Each wave:
    ``connector``, ``in_flight``, ``tokens``, ``busy`` (absent: False), ``pair`` (which wave
    pair; -1: a warm-up wave, not counted), ``seconds``, ``nbytes``, ``prefill_cpu_s``,
    ``decode_cpu_s``, ``mismatched``, and optionally ``prefill_threads`` and
    ``decode_threads`` (name -> CPU s)."""
    modes: dict[str, dict] = {}
    waves = [w for w in waves if w["pair"] >= 0]  # not the warm-up waves

    def mode_of(w: dict) -> str:
        return Mode(w["in_flight"], 0, w["tokens"], w.get("busy", False)).name

    for name in dict.fromkeys(mode_of(w) for w in waves):
        rows = [w for w in waves if mode_of(w) == name]
        entry: dict = {"in_flight": rows[0]["in_flight"], "tokens": rows[0]["tokens"],
                       "busy": rows[0].get("busy", False)}
        for connector in CONNECTORS:
            mine = [w for w in rows if w["connector"] == connector]
            seconds = sum(w["seconds"] for w in mine)
            entry[connector] = {
                "requests": sum(w["in_flight"] for w in mine),
                "ms_per_request": 1e3 * statistics.median(w["seconds"] / w["in_flight"]
                                                          for w in mine),
                "gbps": sum(w["nbytes"] for w in mine) / seconds / 1e9,
                "prefill_cpu_s": sum(w["prefill_cpu_s"] for w in mine),
                "decode_cpu_s": sum(w["decode_cpu_s"] for w in mine),
                "prefill_cpu_by_thread": summed(w.get("prefill_threads", {}) for w in mine),
                "decode_cpu_by_thread": summed(w.get("decode_threads", {}) for w in mine),
                "byte_exact": all(not w["mismatched"] for w in mine),
            }
        by_pair = {}
        for w in rows:
            by_pair.setdefault(w["pair"], {})[w["connector"]] = w["seconds"]
        entry["ratio"] = statistics.median(p["sglang"] / p["dsa-bridge"] for p in by_pair.values()
                                           if len(p) == len(CONNECTORS))
        entry["target_met"] = entry["ratio"] >= TARGET_RATIO
        modes[name] = entry
    return modes


def summed(counts) -> dict[str, float]:
    """Per-name sums of ``counts`` (name -> seconds), largest first."""
    total: dict[str, float] = {}
    for count in counts:
        for name, seconds in count.items():
            total[name] = total.get(name, 0.0) + seconds
    return {name: round(s, 3) for name, s in sorted(total.items(), key=lambda kv: -kv[1])}


def rank_process(connector: str, role: str) -> Driven:
    """One rank's process (``sglang_rank``), started with its connector's environment."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    return Driven(f"{connector} {role}", "dsa_bridge.transfer.bench.sglang_rank", ["--role", role],
                  env={**env, **RANK_ENV, **CONNECTOR_ENV[connector]},
                  start_timeout_s=START_TIMEOUT_S, command_timeout_s=COMMAND_TIMEOUT_S)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectorPair:
    """A connector's prefill and decode ranks, on pools of the same geometry."""

    def __init__(self, connector: str) -> None:
        self.connector = connector
        self.prefill = rank_process(connector, "prefill")
        try:
            self.decode = rank_process(connector, "decode")
        except BaseException:
            self.prefill.stop()
            raise

    def submit_setup(self, sizes: PDSizes) -> None:
        fields = dict(layers=sizes.layers, pool_pages=sizes.pool_pages, slots=sizes.slots,
                      port=free_port(), seed=SEED)
        self.prefill.submit("setup", **fields)
        self.decode.submit("setup", **fields)

    def managers(self) -> list[str]:
        return [self.prefill.reply()["manager"], self.decode.reply()["manager"]]

    def wave(self, mode: Mode, pair: int) -> dict:
        """One wave of ``mode`` (see the module docstring), its figures."""
        requests = wave_requests(mode, pair)
        started = time.monotonic()
        self.decode.submit("prepare", requests=requests)
        self.prefill.submit("prepare", requests=requests)
        self.decode.reply()
        self.prefill.reply()
        prepared = time.monotonic()
        self.decode.submit("wait", busy=mode.busy)
        sent = self.prefill.call("go", busy=mode.busy)
        received = self.decode.reply()
        moved = time.monotonic()
        checked = self.decode.call("verify")
        return {"connector": self.connector, "in_flight": mode.in_flight, "tokens": mode.tokens,
                "busy": mode.busy, "pair": pair, "seconds": received["end"] - sent["start"],
                "nbytes": checked["nbytes"], "mismatched": checked["mismatched"],
                "prefill_cpu_s": sent["cpu_s"], "decode_cpu_s": received["cpu_s"],
                "prefill_threads": sent["threads"], "decode_threads": received["threads"],
                "prefill_seconds": sent["end"] - sent["start"],  # to prefill's last Success
                "prepare_s": prepared - started, "verify_s": time.monotonic() - moved}

    def stop(self) -> None:
        try:
            self.prefill.stop()
        finally:
            self.decode.stop()


def run_section(size: str, progress) -> dict:
    """The section at ``SGLANG_SIZES[size]``: its report (``skipped`` with the reason where
    sglang is not importable here)."""
    problem = sglang_problem()
    if problem is not None:
        progress(f"sglang section skipped: {problem}")
        return {"skipped": problem}
    sizes = SGLANG_SIZES[size]
    started, load = time.monotonic(), os.getloadavg()
    pairs: list[ConnectorPair] = []
    try:
        for connector in CONNECTORS:
            pairs.append(ConnectorPair(connector))
        for pair in pairs:
            pair.submit_setup(sizes)
        managers = {pair.connector: pair.managers() for pair in pairs}
        progress(f"sglang section: ranks ready in {time.monotonic() - started:.0f} s: {managers}")
        waves = []
        for mode in sizes.modes:
            for number in range(-1, mode.waves):  # -1: each connector's warm-up wave
                for pair in pairs:  # A B A B ...
                    waves.append(pair.wave(mode, number))
            progress(f"sglang section: {mode.requests} x {mode.tokens} tokens, "
                     f"{mode.in_flight} in flight{', busy' if mode.busy else ''}, "
                     f"done at {time.monotonic() - started:.0f} s")
    finally:
        for pair in pairs:
            pair.stop()
    mismatched = [f"{w['connector']}: {m}" for w in waves for m in w["mismatched"]]
    if mismatched:
        raise RuntimeError(f"sglang section: bytes differ after the transfer: {mismatched[:5]}")
    return {"layers": sizes.layers, "managers": managers,
            "load_average": {"start": load, "end": os.getloadavg()},
            "seconds": round(time.monotonic() - started, 1), "target": TARGET_RATIO,
            "modes": summarize(waves), "waves": waves}


def print_section(section: dict) -> None:
    """The section as a table (or why it was skipped)."""
    if "skipped" in section:
        print(f"\nsglang: skipped ({section['skipped']})")
        return
    load = section["load_average"]
    print(f"\nsglang's own Mooncake connector against dsa-bridge's (DeepSeek-V3.2, "
          f"{section['layers']} layers, {section['seconds']:.0f} s, load average "
          f"{load['start'][0]:.1f} -> {load['end'][0]:.1f})")
    print(f"{'in flight x tokens':18} {'connector':10} {'requests':>8} {'ms/req':>7} {'GB/s':>6} "
          f"{'prefill cpu s':>13} {'decode cpu s':>12} {'exact':>5} {'ratio':>6}")
    for name, entry in section["modes"].items():
        for connector in CONNECTORS:
            row = entry[connector]
            ratio = f"{entry['ratio']:>5.2f}x" if connector == CONNECTORS[-1] else ""
            print(f"{name:18} {connector:10} {row['requests']:>8} {row['ms_per_request']:>7.1f} "
                  f"{row['gbps']:>6.2f} {row['prefill_cpu_s']:>13.2f} {row['decode_cpu_s']:>12.2f} "
                  f"{'yes' if row['byte_exact'] else 'NO':>5} {ratio:>6}")
    print("decode CPU s by thread, the four largest:")
    for name, entry in section["modes"].items():
        for connector in CONNECTORS:
            threads = list(entry[connector]["decode_cpu_by_thread"].items())[:4]
            print(f"  {name:18} {connector:10} "
                  + ", ".join(f"{thread} {seconds:.2f}" for thread, seconds in threads))
