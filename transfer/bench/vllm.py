"""The ``vllm`` section of ``dsa-bridge bench``: the same requests through vLLM's own
NixlConnector and through dsa-bridge's connector, each driven by vLLM's own scheduler and worker
calls on vLLM's DSA caches, prefill and decode in their own processes, byte-exact; and
dsa-bridge's against the raw engine writing the same descriptors.

Where vllm is installed (``.venv-vllm``), four instance processes (``bench.vllm_rank``): a
prefill and a decode per connector, each vLLM's ``Scheduler``, caches (DeepSeek-V3.2's
geometry cut to ``layers`` layers, blocks of 64) and the connector vLLM's
``KVConnectorFactory`` makes; NIXL (UCX) on loopback for both. vLLM's NixlConnector runs on
this CPU build only with what ``vllm_rank.vllm_nixl_on_cpu`` sets (``VLLM_NIXL_ON_CPU``);
without it, it refuses the caches (``NIXL_REFUSAL``). Its default pull mode: decode reads.

A wave of ``in_flight`` requests: prefill computes them (its stand-in forward fills every page
of both caches with the launcher's pattern; not timed) and answers; decode adds them with the
answers and steps vLLM until it saw the last one's load finished (``finished_recving``): the
timed window, vLLM's own scheduling and steps included; then decode compares every page. The
connectors' waves alternate (A B, then B A). vLLM's own instances are paused (SIGSTOP by PID,
``Pair.pause``) while dsa-bridge's waves run, and resumed for their own: their NIXL agents run
NIXL's progress thread (vLLM's default), which polls without pause: idle, they took 0.7 of a
core at a load of 25 on these two cores, dsa-bridge's 0.08 (``idle_cores``, measured by each run
before its waves and reported); dsa-bridge's idle instances stay up. ``ratio`` is the median
over wave pairs of vLLM's seconds over dsa-bridge's (above 1: dsa-bridge faster). The fragmented
mode reorders decode's free blocks so that no two blocks of a request are adjacent (one block
per run) and runs dsa-bridge's prefill on each route, ``ratio`` taken with ``auto`` (its default,
which takes the route its measured costs say is cheaper: ``route_costs``), ``direct_ratio`` and
``staged_ratio`` with each route forced. ``ratio_vs_raw``: dsa-bridge's direct
waves against the prefill's engine writing the same (prefill block, decode block) pages,
planned as its node plans them, in one write right after the wave (the core bench's raw
baseline). Each mode's first waves are a warm-up: checked, not counted.

This module does not import vllm: the bench process only drives the instances.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .channel import Driven
from .sglang_pd import free_port

PAGE = 64
TARGETS = {"ratio": 1.0, "fragmented_ratio": 1.25, "ratio_vs_raw": 0.9}
START_TIMEOUT_S = 180.0  # an instance imports vllm and builds its config: tens of seconds loaded
COMMAND_TIMEOUT_S = 300.0
RANK_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error",
            "VLLM_LOGGING_LEVEL": "WARNING"}
CONNECTORS = ("vllm", "dsa-bridge")  # vllm: vLLM's own NixlConnector
NIXL_REFUSAL = (
    "with DSA's 64-token blocks, vLLM 0.32.0's NixlConnector on the CPU refuses the caches at "
    "register_kv_caches ('KV cache view cannot be partitioned into NIXL regions: ... "
    "block_stride=41984, physical_page_size=10496'): it takes the CPU MLA backend's kernel "
    "block of 16 tokens and cuts each block into four pages the cache is no whole number of")
VLLM_NIXL_ON_CPU = (
    "nixl imported as the installed nixl_cu12; the CPU MLA backend's kernel block claimed as "
    "64 (no attention kernel runs here); vLLM's parallel state of one rank (gloo); the "
    "scheduler side given the worker's handshake metadata, as vLLM's engine core does; "
    "kv_buffer_device cpu, the UCX backend")


@dataclass(frozen=True)
class Mode:
    """``waves`` waves (after a warm-up) of ``in_flight`` requests of ``tokens`` tokens;
    ``fragmented``: decode's blocks one per run, dsa-bridge on each route."""

    in_flight: int
    tokens: int
    waves: int
    fragmented: bool = False

    @property
    def name(self) -> str:
        return f"{self.in_flight} x {self.tokens}" + (" fragmented" if self.fragmented else "")

    @property
    def blocks(self) -> int:
        """Blocks a wave needs on decode (a prompt's, and one for its sampled token), twice
        over when fragmented (every other block)."""
        return self.in_flight * (self.tokens // PAGE + 1) * (2 if self.fragmented else 1)

    def runs(self) -> list[tuple[str, str]]:
        """(connector, route) of one wave pair."""
        routes = ("direct", "staged", "auto") if self.fragmented else ("direct",)
        return [("vllm", "pull")] + [("dsa-bridge", route) for route in routes]


@dataclass(frozen=True)
class VllmSizes:
    layers: int
    modes: tuple[Mode, ...]

    @property
    def blocks(self) -> int:
        return max(m.blocks for m in self.modes) + 8


VLLM_SIZES = {
    "full": VllmSizes(61, (Mode(1, 8192, 6), Mode(8, 2048, 6), Mode(1, 4096, 6, True))),
    "quick": VllmSizes(61, (Mode(1, 4096, 3), Mode(8, 1024, 3), Mode(1, 2048, 3, True))),
    "tiny": VllmSizes(4, (Mode(1, 256, 1), Mode(2, 128, 1), Mode(1, 256, 1, True))),
}


def vllm_problem() -> str | None:
    """Why the section cannot run in this interpreter (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return (f"vllm not installed ({sys.executable}): the vllm section runs where vllm is "
                "installed (.venv-vllm, see docs/vllm.md)")
    return None


def instance(connector: str, role: str) -> Driven:
    return Driven(f"{connector} {role}", "dsa_bridge.transfer.bench.vllm_rank", ["--role", role],
                  env={**os.environ, **RANK_ENV}, start_timeout_s=START_TIMEOUT_S,
                  command_timeout_s=COMMAND_TIMEOUT_S)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` ran so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cores(pairs: dict[str, Pair], seconds: float = 3.0) -> dict[str, float]:
    """The cores each connector's two instances keep busy while no wave runs (none paused)."""
    pids = {c: [d.process.pid for d in (p.prefill, p.decode)] for c, p in pairs.items()}
    before = {c: sum(map(process_cpu_s, ids)) for c, ids in pids.items()}
    time.sleep(seconds)
    return {c: round((sum(map(process_cpu_s, ids)) - before[c]) / seconds, 3)
            for c, ids in pids.items()}


class Pair:
    """A connector's prefill and decode instances (``start(connector, role)``), and the waves
    they run."""

    def __init__(self, connector: str, sizes: VllmSizes, model_dir: str, start=None) -> None:
        start = start or instance
        self.connector = connector
        self.prefill = start(connector, "prefill")
        try:
            self.decode = start(connector, "decode")
        except BaseException:
            self.prefill.stop()
            raise
        self.fields = dict(model_dir=model_dir, blocks=sizes.blocks, engine="nixl",
                           connector="nixl" if connector == "vllm" else "dsa-bridge")
        self.waves = 0
        self.peer: dict | None = None
        self.paused = False

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) both instances, by PID; nothing is in flight
        between waves."""
        if paused == self.paused:
            return
        for driven in (self.prefill, self.decode):
            if driven.process.poll() is None:
                os.kill(driven.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
        self.paused = paused

    def submit_setup(self) -> None:
        self.prefill.submit("setup", **self.fields, port=free_port(), ports=[free_port(), free_port()])
        self.decode.submit("setup", **self.fields, ports=[free_port(), free_port()])

    def setup_done(self) -> None:
        self.prefill.reply()
        self.decode.reply()

    def wave(self, mode: Mode, route: str, pair: int) -> dict:
        """One wave (dsa-bridge's prefill on ``route``): its window, bytes, descriptors and
        pages that differ, and after a direct dsa-bridge wave the raw engine's write of the
        same pages."""
        self.waves += 1
        requests = [[f"w{self.waves}-{i}", mode.tokens, self.waves * 100 + i]
                    for i in range(mode.in_flight)]
        self.prefill.call("order", kind="sorted")  # each request's prefill blocks one run
        sent = self.prefill.call("prefill", requests=requests, route=route)
        self.decode.call("order", kind="stride2" if mode.fragmented else "sorted")
        got = self.decode.call("load", answers=sent["answers"],
                               numbers={r: n for r, _, n in requests})
        written = self.prefill.call("drain")
        wave = {"connector": self.connector, "mode": mode.name, "route": route, "pair": pair,
                "seconds": got["seconds"], "decode_cpu_s": got["cpu_s"], "nbytes": got["nbytes"],
                "descriptors": written["descriptors"], "written_bytes": written["bytes"],
                "differ": {r: n for r, n in got["differ"].items() if n}}
        if self.connector == "dsa-bridge" and route == "direct":
            if self.peer is None:
                reply = self.decode.call("peer")
                self.peer = {"metadata": reply["metadata"], "buffers": reply["buffers"]}
            pages = [[sent["blocks"][r][:len(got["blocks"][r])], got["blocks"][r]]
                     for r, _, _ in requests]
            raw = self.prefill.call("raw", requests=pages, **self.peer)
            wave.update(raw_seconds=raw["seconds"], raw_descriptors=raw["descriptors"],
                        raw_bytes=raw["nbytes"])
        return wave

    def stop(self) -> None:
        self.pause(False)  # a stopped process cannot take its quit command
        try:
            self.decode.stop()  # first: a decode node would report its prefill's end
        finally:
            self.prefill.stop()


def exact(wave: dict) -> bool:
    """Every page as prefill wrote it (and dsa-bridge's node wrote exactly those bytes)."""
    return not wave["differ"] and wave["written_bytes"] in (None, wave["nbytes"])


def summarize(mode: Mode, waves: list[dict]) -> dict:
    """A mode's figures over its counted waves (see the module docstring)."""
    def rows(connector: str, route: str) -> list[dict]:
        return [w for w in waves if w["connector"] == connector and w["route"] == route]

    def figures(mine: list[dict]) -> dict:
        seconds = sum(w["seconds"] for w in mine)
        return {"ms_per_request": 1e3 * statistics.median(w["seconds"] for w in mine) / mode.in_flight,
                "gbps": sum(w["nbytes"] for w in mine) / seconds / 1e9,
                "decode_cpu_s": sum(w["decode_cpu_s"] for w in mine),
                "descriptors": statistics.median_low(w["descriptors"] or 0 for w in mine) or None,
                "byte_exact": all(map(exact, mine))}  # descriptors: auto's most waves' route

    def over_pairs(numerator: list[dict], denominator: list[dict]) -> float:
        """The median over wave pairs of one side's seconds over the other's."""
        return statistics.median(n["seconds"] / d["seconds"]
                                 for n, d in zip(numerator, denominator, strict=True))

    own, direct = rows("vllm", "pull"), rows("dsa-bridge", "direct")
    bridge = rows("dsa-bridge", "auto") if mode.fragmented else direct
    target = TARGETS["fragmented_ratio" if mode.fragmented else "ratio"]
    ratio = over_pairs(own, bridge)
    vs_raw = statistics.median(w["raw_seconds"] / w["seconds"] for w in direct)
    entry = {"in_flight": mode.in_flight, "tokens": mode.tokens, "vllm": figures(own),
             "dsa-bridge": figures(bridge), "ratio": ratio, "target": target,
             "target_met": ratio >= target, "ratio_vs_raw": vs_raw,
             "raw_ms": 1e3 * statistics.median(w["raw_seconds"] for w in direct),
             "descriptors_exact": all(w["descriptors"] == w["raw_descriptors"]
                                      and w["raw_bytes"] == w["nbytes"] for w in direct)}
    if mode.fragmented:
        staged = rows("dsa-bridge", "staged")
        entry["dsa-bridge direct"], entry["dsa-bridge staged"] = figures(direct), figures(staged)
        entry["staged_vs_direct"] = over_pairs(direct, staged)
        entry["direct_ratio"], entry["staged_ratio"] = over_pairs(own, direct), over_pairs(own, staged)
    else:
        entry["raw_target_met"] = vs_raw >= TARGETS["ratio_vs_raw"]
    return entry


def write_model(directory: str, layers: int) -> None:
    """The one ``config.json`` every instance reads (vLLM's NixlConnector compares a hash of
    the configs at its handshake)."""
    from .vllm_rank import MODEL

    Path(directory, "config.json").write_text(json.dumps({**MODEL, "num_hidden_layers": layers}))


def run_section(size: str, progress) -> dict:
    """The section at ``VLLM_SIZES[size]``: its report (``skipped`` with the reason where vllm
    is not installed here)."""
    problem = vllm_problem()
    if problem is not None:
        progress(f"vllm section skipped: {problem}")
        return {"skipped": problem}
    sizes = VLLM_SIZES[size]
    started, load = time.monotonic(), os.getloadavg()
    modes, waves, pairs, idle = {}, [], {}, {}
    with tempfile.TemporaryDirectory(prefix="dsa-bridge-bench-vllm-") as model_dir:
        write_model(model_dir, sizes.layers)
        try:
            for connector in CONNECTORS:
                pairs[connector] = Pair(connector, sizes, model_dir)
            for pair in pairs.values():
                pair.submit_setup()
            for pair in pairs.values():
                pair.setup_done()
            progress(f"vllm section: instances ready in {time.monotonic() - started:.0f} s")
            idle = idle_cores(pairs)
            for mode in sizes.modes:
                done = []
                for number in range(-1, mode.waves):  # -1: the warm-up
                    runs = mode.runs() if number % 2 else mode.runs()[::-1]
                    for connector, route in runs:
                        pairs["vllm"].pause(connector != "vllm")
                        done.append(pairs[connector].wave(mode, route, number))
                differ = [f"{w['connector']} {w['mode']} {w['route']}: {w['differ']}"
                          for w in done if not exact(w)]
                if differ:
                    raise RuntimeError(f"vllm section: bytes differ after the transfer: {differ[:3]}")
                counted = [w for w in done if w["pair"] >= 0]
                modes[mode.name] = summarize(mode, counted)
                waves += counted
                progress(f"vllm section: {mode.name} done at {time.monotonic() - started:.0f} s")
        finally:
            for pair in pairs.values():
                pair.stop()
    return {"layers": sizes.layers, "engine": "nixl", "vllm_nixl_on_cpu": VLLM_NIXL_ON_CPU,
            "idle_cores": idle,
            "vllm_nixl_refusal": NIXL_REFUSAL,
            "load_average": {"start": load, "end": os.getloadavg()},
            "seconds": round(time.monotonic() - started, 1), "modes": modes, "waves": waves}


def print_section(section: dict) -> None:
    """The section as a table (or why it was skipped)."""
    if "skipped" in section:
        print(f"\nvllm: skipped: {section['skipped']}")
        return
    load = section["load_average"]
    print(f"\nvLLM's own NixlConnector against dsa-bridge's (NIXL, DeepSeek-V3.2 caches, "
          f"{section['layers']} layers, {section['seconds']:.0f} s, load average "
          f"{load['start'][0]:.1f} -> {load['end'][0]:.1f})")
    print(f"vLLM's NixlConnector on this CPU: {section['vllm_nixl_on_cpu']}")
    print(f"Cores the idle instances kept busy: {section['idle_cores']} (vLLM's own paused "
          "during dsa-bridge's waves)")
    print(f"{'in flight x tokens':24} {'connector':18} {'ms/req':>8} {'GB/s':>6} {'descr.':>7} "
          f"{'exact':>5}")
    for name, entry in section["modes"].items():
        for connector in [c for c in ("vllm", "dsa-bridge direct", "dsa-bridge staged",
                                      "dsa-bridge") if c in entry]:
            row = entry[connector]
            label = "dsa-bridge auto" if connector == "dsa-bridge" and "staged_vs_direct" in entry \
                else connector
            print(f"{name:24} {label:18} {row['ms_per_request']:>8.1f} {row['gbps']:>6.2f} "
                  f"{row['descriptors'] if row['descriptors'] is not None else '-':>7} "
                  f"{'yes' if row['byte_exact'] else 'NO':>5}")
        met = "met" if entry["target_met"] else "NOT met"
        raw = "" if "raw_target_met" not in entry else \
            f" (target >= {TARGETS['ratio_vs_raw']}: {'met' if entry['raw_target_met'] else 'NOT met'})"
        print(f"{'':24} ratio dsa-bridge / vLLM's own {entry['ratio']:.2f} (target >= "
              f"{entry['target']}: {met}); ratio_vs_raw {entry['ratio_vs_raw']:.2f}{raw}"
              + (f"; direct_ratio {entry['direct_ratio']:.2f}; staged_ratio "
                 f"{entry['staged_ratio']:.2f}; staged_vs_direct {entry['staged_vs_direct']:.2f}"
                 if "staged_vs_direct" in entry else ""))
