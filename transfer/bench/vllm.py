"""The ``vllm`` section of ``dsa-bridge bench``: the same requests through dsa-bridge's vLLM
connector, driven by vLLM's own scheduler and worker calls, against the raw engine writing the
same descriptors, and on a fragmented block table the staged route against the direct one.

vLLM's own NixlConnector cannot be the baseline here: on the CPU it refuses these caches at
``register_kv_caches`` (``NIXL_REFUSAL``; docs/vllm.md), so the section measures the issue's
fallback. Where vllm is installed (``.venv-vllm``), two instance processes
(``bench.vllm_rank``): a prefill and a decode, each vLLM's scheduler, caches and dsa-bridge's
connector (DeepSeek-V3.2's cache geometry cut to ``layers`` layers, blocks of 64).

A wave of ``in_flight`` requests: prefill computes them (its stand-in forward fills every page
of both caches with the launcher's pattern; not timed) and answers; decode adds them with the
answers and steps vLLM until it saw the last one's load finished (``finished_recving``): the
timed window, vLLM's own scheduling and steps included; then decode compares every page.
``raw``: the prefill's engine writes the same (prefill block, decode block) pages planned as
its node plans them, in one write (the core bench's raw baseline), right after each wave.
``ratio_vs_raw`` is the median over waves of raw seconds over the wave's; the fragmented mode
(decode's free blocks reordered so that no two blocks of a request are adjacent: one block per
run) alternates the prefill node's route, ``ratio`` the median of direct over staged seconds.
Each mode's first wave is a warm-up: checked, not counted.

This module does not import vllm: the bench process only drives the instances.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from dataclasses import dataclass

from .channel import Driven

PAGE = 64
TARGETS = {"ratio_vs_raw": 0.9, "staged_vs_direct": 1.25}
START_TIMEOUT_S = 180.0  # an instance imports vllm and builds its config: tens of seconds loaded
COMMAND_TIMEOUT_S = 300.0
RANK_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error",
            "VLLM_LOGGING_LEVEL": "WARNING"}
NIXL_REFUSAL = (
    "vLLM 0.32.0's NixlConnector (kv_buffer_device cpu, nixl aliased to nixl_cu12, vLLM's "
    "parallel state set up) refuses DSA caches at register_kv_caches: 'KV cache view cannot be "
    "partitioned into NIXL regions: ... num_blocks=384, block_stride=41984, "
    "physical_page_size=10496': on the CPU it takes the kernel block size of the CPU MLA "
    "backend (16 tokens), cuts each 64-token block into four 10,496-byte pages and finds the "
    "cache's bytes no whole number of such segments")


@dataclass(frozen=True)
class Mode:
    """``waves`` waves (after a warm-up) of ``in_flight`` requests of ``tokens`` tokens;
    ``fragmented``: decode's blocks one per run, the staged and direct routes alternating."""

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


@dataclass(frozen=True)
class VllmSizes:
    layers: int
    modes: tuple[Mode, ...]

    @property
    def blocks(self) -> int:
        return max(m.blocks for m in self.modes) + 8


VLLM_SIZES = {
    "full": VllmSizes(61, (Mode(1, 8192, 8), Mode(8, 2048, 8), Mode(1, 4096, 8, True))),
    "quick": VllmSizes(61, (Mode(1, 8192, 4), Mode(8, 2048, 4), Mode(1, 4096, 4, True))),
    "tiny": VllmSizes(4, (Mode(1, 256, 1), Mode(2, 128, 1), Mode(1, 256, 1, True))),
}


def vllm_problem() -> str | None:
    """Why the section cannot run in this interpreter (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return (f"vllm not installed ({sys.executable}): the vllm section runs where vllm is "
                "installed (.venv-vllm, see docs/vllm.md)")
    return None


def instance(role: str) -> Driven:
    return Driven(f"vllm {role}", "dsa_bridge.transfer.bench.vllm_rank", ["--role", role],
                  env={**os.environ, **RANK_ENV}, start_timeout_s=START_TIMEOUT_S,
                  command_timeout_s=COMMAND_TIMEOUT_S)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """The prefill and decode instances, and the waves they run."""

    def __init__(self, sizes: VllmSizes, engine: str) -> None:
        self.prefill = instance("prefill")
        try:
            self.decode = instance("decode")
        except BaseException:
            self.prefill.stop()
            raise
        fields = dict(layers=sizes.layers, blocks=sizes.blocks, engine=engine,
                      max_tokens=max(m.tokens for m in sizes.modes))
        self.prefill.submit("setup", **fields, port=free_port())
        self.decode.submit("setup", **fields)
        self.prefill.reply()
        self.decode.reply()
        self.waves = 0
        self.peer: dict | None = None

    def wave(self, mode: Mode, route: str) -> dict:
        """One wave on ``route``: its window, bytes, descriptors and pages that differ, and the
        raw engine's write of the same pages (not after a staged wave)."""
        self.waves += 1
        requests = [[f"w{self.waves}-{i}", mode.tokens, self.waves * 100 + i]
                    for i in range(mode.in_flight)]
        self.prefill.call("order", kind="sorted")  # each request's prefill blocks one run
        sent = self.prefill.call("prefill", requests=requests, route=route)
        self.decode.call("order", kind="stride2" if mode.fragmented else "sorted")
        got = self.decode.call("load", answers=sent["answers"],
                               numbers={r: n for r, _, n in requests})
        written = self.prefill.call("drain")
        wave = {"mode": mode.name, "route": route, "seconds": got["seconds"],
                "decode_cpu_s": got["cpu_s"], "nbytes": got["nbytes"],
                "descriptors": written["descriptors"], "written_bytes": written["bytes"],
                "differ": {r: n for r, n in got["differ"].items() if n}}
        if route == "direct":
            if self.peer is None:
                reply = self.decode.call("peer")
                self.peer = {"metadata": reply["metadata"], "buffers": reply["buffers"]}
            pages = [[sent["blocks"][r][:len(got["blocks"][r])], got["blocks"][r]] for r, _, _ in requests]
            raw = self.prefill.call("raw", requests=pages, **self.peer)
            wave.update(raw_seconds=raw["seconds"], raw_descriptors=raw["descriptors"],
                        raw_bytes=raw["nbytes"])
        return wave

    def stop(self) -> None:
        try:
            self.decode.stop()  # first: a decode node would report its prefill's end
        finally:
            self.prefill.stop()


def summarize(mode: Mode, waves: list[dict]) -> dict:
    """A mode's figures over its counted waves (see the module docstring)."""
    def ms(rows):
        return 1e3 * statistics.median(w["seconds"] for w in rows) / mode.in_flight

    entry: dict = {"in_flight": mode.in_flight, "tokens": mode.tokens,
                   "byte_exact": all(not w["differ"] and w["written_bytes"] == w["nbytes"]
                                     for w in waves)}
    direct = [w for w in waves if w["route"] == "direct"]
    if mode.fragmented:
        staged = [w for w in waves if w["route"] == "staged"]
        ratio = statistics.median(d["seconds"] / s["seconds"] for d, s in zip(direct, staged, strict=True))
        entry.update(direct_ms_per_request=ms(direct), staged_ms_per_request=ms(staged),
                     direct_descriptors=direct[0]["descriptors"],
                     staged_descriptors=staged[0]["descriptors"], ratio=ratio,
                     target=TARGETS["staged_vs_direct"], target_met=ratio >= TARGETS["staged_vs_direct"])
    else:
        ratio = statistics.median(w["raw_seconds"] / w["seconds"] for w in direct)
        seconds = sum(w["seconds"] for w in direct)
        entry.update(ms_per_request=ms(direct), gbps=sum(w["nbytes"] for w in direct) / seconds / 1e9,
                     raw_ms=1e3 * statistics.median(w["raw_seconds"] for w in direct),
                     descriptors=direct[0]["descriptors"],
                     descriptors_exact=all(w["descriptors"] == w["raw_descriptors"]
                                           and w["raw_bytes"] == w["nbytes"] for w in direct),
                     ratio_vs_raw=ratio, target=TARGETS["ratio_vs_raw"],
                     target_met=ratio >= TARGETS["ratio_vs_raw"])
    return entry


def run_section(size: str, progress, engine: str = "nixl") -> dict:
    """The section at ``VLLM_SIZES[size]`` on ``engine``: its report (``skipped`` with the reason
    where vllm is not installed here)."""
    problem = vllm_problem()
    if problem is not None:
        progress(f"vllm section skipped: {problem}")
        return {"skipped": problem}
    sizes = VLLM_SIZES[size]
    started, load = time.monotonic(), os.getloadavg()
    pair = Pair(sizes, engine)
    progress(f"vllm section: instances ready in {time.monotonic() - started:.0f} s")
    modes, waves = {}, []
    try:
        for mode in sizes.modes:
            routes = ("direct", "staged") if mode.fragmented else ("direct",)
            warm = [pair.wave(mode, route) for route in routes]
            counted = []
            for number in range(mode.waves):
                order = routes if number % 2 == 0 else routes[::-1]
                counted += [pair.wave(mode, route) for route in order]
            differ = [f"{w['mode']} {w['route']}: {w['differ']}" for w in warm + counted
                      if w["differ"] or w["written_bytes"] != w["nbytes"]]
            if differ:
                raise RuntimeError(f"vllm section: bytes differ after the transfer: {differ[:3]}")
            modes[mode.name] = summarize(mode, counted)
            waves += counted
            progress(f"vllm section: {mode.name} done at {time.monotonic() - started:.0f} s")
    finally:
        pair.stop()
    return {"layers": sizes.layers, "engine": engine, "vllm_nixl": NIXL_REFUSAL,
            "load_average": {"start": load, "end": os.getloadavg()},
            "seconds": round(time.monotonic() - started, 1), "modes": modes, "waves": waves}


def print_section(section: dict) -> None:
    """The section as a table (or why it was skipped)."""
    if "skipped" in section:
        print(f"\nvllm: skipped: {section['skipped']}")
        return
    load = section["load_average"]
    print(f"\ndsa-bridge's vLLM connector ({section['engine']}, DeepSeek-V3.2 caches, "
          f"{section['layers']} layers, {section['seconds']:.0f} s, load average "
          f"{load['start'][0]:.1f} -> {load['end'][0]:.1f})")
    print(f"vLLM's own NixlConnector: not run: {section['vllm_nixl']}")
    for name, entry in section["modes"].items():
        exact = "byte-exact" if entry["byte_exact"] else "BYTES DIFFER"
        met = "met" if entry["target_met"] else "NOT met"
        if "ratio_vs_raw" in entry:
            print(f"{name:22} {entry['ms_per_request']:8.1f} ms/req {entry['gbps']:6.2f} GB/s, raw "
                  f"engine {entry['raw_ms']:8.1f} ms, {entry['descriptors']} descriptors: "
                  f"ratio_vs_raw {entry['ratio_vs_raw']:.2f} (target >= {entry['target']}: {met}), "
                  f"{exact}")
        else:
            print(f"{name:22} direct {entry['direct_ms_per_request']:8.1f} ms ("
                  f"{entry['direct_descriptors']} descriptors), staged "
                  f"{entry['staged_ms_per_request']:8.1f} ms ({entry['staged_descriptors']}): "
                  f"staged_vs_direct {entry['ratio']:.2f} (target >= {entry['target']}: {met}), "
                  f"{exact}")
