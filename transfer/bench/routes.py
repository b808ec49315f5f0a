"""The route sweeps of ``dsa-bridge bench``, and its ``routes`` section.

The sweeps: one DeepSeek-V3.2 request (all 61 layers, ``sweep_tokens``) in each page pattern
(contiguous, fragmented, one page per descriptor) and with N pages per descriptor (the crossover),
on the direct route, the staged route and ``auto``. In the core section each is a point of its
own (``route_summary``: ``auto`` after the two forced routes, on the same prefill node, so it
weighs what that node timed of both, ``route_costs.RouteCosts``). The ``routes`` section runs the
sweeps alone and compares the routes of each point interleaved, round by round (``compare``),
so that the load of a shared machine falls on all of them alike: ``auto_vs_faster``,
``auto``'s speed over the faster forced route's, target ``AUTO_VS_FASTER`` (at most 10 % slower).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from .sizes import SIZES

AUTO_VS_FASTER = 0.9
ROUTE_SWEEPS = ("descriptors", "crossover")
FORCED = ("direct", "staged")
ORDER = ("direct", "staged", "auto", "control")  # control: the direct route again
ROUTE_ROUNDS = 8  # interleaved rounds per point at least: each route twice in each place


def route_summary(transfers: list[dict], backends: list[str]) -> dict:
    """Per backend and page pattern of the route sweeps: each route's GB/s over that of the
    contiguous request of the same length (the length sweep's, direct) measured in the same run
    (``vs_contiguous``), its descriptors and the route it took; the faster forced route; and
    ``auto``'s GB/s over the faster's (``auto_vs_faster``)."""
    out = {}
    for backend in backends:
        rows = [r for r in transfers if r["backend"] == backend]
        points = [r for r in rows if r["sweep"] in ROUTE_SWEEPS]
        base = next(r for r in rows if r["sweep"] == "length" and r["tokens"] == points[0]["tokens"])
        patterns: dict[str, dict] = {}
        for row in [base, *points]:
            patterns.setdefault(row["pattern"], {})[row["route"]] = {
                "vs_contiguous": row["e2e_gbps"] / base["e2e_gbps"],
                "descriptors": row["descriptors"], "e2e_gbps": row["e2e_gbps"],
                "route_taken": row["route_taken"], "staging_bytes": row["staging_bytes"]}
        for entry in patterns.values():
            entry["faster"] = max(("direct", "staged"), key=lambda route: entry[route]["e2e_gbps"])
            entry["auto_vs_faster"] = entry["auto"]["e2e_gbps"] / entry[entry["faster"]]["e2e_gbps"]
        out[backend] = patterns
    return out


def auto_vs_faster(routes: dict) -> dict:
    """Per backend, the lowest ``auto_vs_faster`` of the sweeps' points, and whether it meets
    ``AUTO_VS_FASTER``."""
    lowest = {b: min(e["auto_vs_faster"] for e in by.values()) for b, by in routes.items()}
    return {"lowest": lowest, "met": {b: v >= AUTO_VS_FASTER for b, v in lowest.items()}}


def choice_vs_faster(routes: dict) -> dict:
    """Per backend, the lowest ``choice_vs_faster`` of the section's points."""
    return {b: min(e["choice_vs_faster"] for e in by.values()) for b, by in routes.items()}


def compare(session, requests: list, rounds: int) -> dict:
    """``direct``, ``staged`` and ``auto`` end to end on the same requests, interleaved (each round
    the order turned by one, so that each route holds each place as often, and after each staged
    run one direct run not counted: a run right after a staged one measured slower, whatever its
    route), after two
    warm-up runs of each forced route (the node times them: ``auto`` weighs what it saw) and one
    of ``auto``: each route's median seconds, the faster forced route, the route ``auto`` took
    (``mixed``: some runs each) and ``auto_vs_faster``, the faster route's median seconds over
    ``auto``'s (on a loaded machine steadier than the median of the rounds' ratios, also given:
    ``auto_vs_faster_pairs``); and ``choice_vs_faster``, the faster route's median over that of
    the forced routes in the shares ``auto`` took them: how good its choice was, whatever the
    noise of its own runs. A fourth run each round, ``control``, is the direct route again:
    ``control_vs_direct`` is what the same work measures against itself, the noise floor of
    every ratio here."""
    for route in (*FORCED, *FORCED, "auto"):
        session.end_to_end(requests, route=route)
    samples: dict[str, list[float]] = {route: [] for route in ORDER}
    staged_runs = 0
    for i in range(rounds):
        for route in ORDER[i % len(ORDER):] + ORDER[:i % len(ORDER)]:
            transfer = session.end_to_end(requests, route="direct" if route == "control" else route)
            samples[route].append(transfer.seconds)
            if route == "staged":
                session.end_to_end(requests, route="direct")  # settles, not counted
            if route == "auto":
                staged_runs += transfer.staged_chunks > 0
    medians = {route: statistics.median(v) for route, v in samples.items()}
    faster = min(FORCED, key=medians.__getitem__)
    share = staged_runs / rounds
    chosen_s = (1 - share) * medians["direct"] + share * medians["staged"]
    return {"seconds": medians, "samples_s": samples, "faster": faster,
            "auto_taken": {0: "direct", rounds: "staged"}.get(staged_runs, "mixed"),
            "auto_vs_faster": medians[faster] / medians["auto"],
            "choice_vs_faster": medians[faster] / chosen_s,
            "control_vs_direct": medians["direct"] / medians["control"],
            "auto_vs_faster_pairs": statistics.median(
                f / a for f, a in zip(samples[faster], samples["auto"], strict=True)),
            "bytes": transfer.nbytes}


def run_section(size: str, backends: list[str], progress: Callable[[str], None]) -> dict:
    """The route sweeps of run size ``size`` on each backend, each point's three routes compared
    (``compare``), against the contiguous request's faster route."""
    from . import measure  # torch, the nodes and the engines
    from .child import PAGE, start_child

    sizes = SIZES[size]
    geometry, points = measure.transfer_jobs(sizes)[0]
    patterns = list(dict.fromkeys(p[1] for p in points if p[0] in ROUTE_SWEEPS))
    pages = sizes.sweep_tokens // PAGE
    rounds = -(-max(sizes.repeat, ROUTE_ROUNDS) // len(ORDER)) * len(ORDER)
    started, load = time.monotonic(), os.getloadavg()
    out: dict[str, dict] = {}
    child = start_child()
    try:
        for backend in backends:
            session = measure.TransferSession(child, backend, geometry)
            try:
                for pattern in patterns:
                    entry = compare(session, measure.page_ids(pattern, pages), rounds)
                    out.setdefault(backend, {})[pattern] = entry
                    progress(f"routes {backend} {pattern}: direct {entry['seconds']['direct']:.3f}"
                             f" s, staged {entry['seconds']['staged']:.3f} s, auto "
                             f"{entry['seconds']['auto']:.3f} s ({entry['auto_taken']}): "
                             f"{entry['auto_vs_faster']:.2f} of the faster")
            finally:
                session.close()
                measure.trim_heap()
    finally:
        child.stop()
    summary = auto_vs_faster(out)
    return {"size": size, "rounds": rounds, "backends": backends, "tokens": sizes.sweep_tokens,
            "load_average": {"start": load, "end": os.getloadavg()},
            "seconds": round(time.monotonic() - started, 1), "routes": out,
            "auto_vs_faster_lowest": summary["lowest"], "target": AUTO_VS_FASTER,
            "choice_vs_faster_lowest": choice_vs_faster(out),
            "control_vs_direct": {b: [min(e["control_vs_direct"] for e in by.values()),
                                      max(e["control_vs_direct"] for e in by.values())]
                                  for b, by in out.items()},
            "targets_met": {"auto_vs_faster": summary["met"]}}


def print_section(section: dict) -> None:
    load = section["load_average"]
    print(f"\nroutes ({section['size']}, {section['tokens']} tokens, {section['rounds']} rounds, "
          f"{section['seconds']:.0f} s, load average {load['start'][0]:.1f} -> "
          f"{load['end'][0]:.1f})")
    for backend, patterns in section["routes"].items():
        for pattern, entry in patterns.items():
            gbps = {r: entry["bytes"] / s / 1e9 for r, s in entry["seconds"].items()}
            print(f"{backend} {pattern}: direct {gbps['direct']:.2f} GB/s, staged "
                  f"{gbps['staged']:.2f}, auto {gbps['auto']:.2f} (took {entry['auto_taken']}): "
                  f"{entry['auto_vs_faster']:.2f} of the faster ({entry['faster']}); its choice "
                  f"{entry['choice_vs_faster']:.2f}; direct against itself "
                  f"{entry['control_vs_direct']:.2f}")
    print(f"auto against the faster route, lowest point (target >= {section['target']}): "
          f"{section['auto_vs_faster_lowest']}; met: {section['targets_met']['auto_vs_faster']}; "
          f"its choice, lowest point: {section['choice_vs_faster_lowest']}; the direct route "
          f"against itself, lowest and highest point: {section['control_vs_direct']}")


def print_routes(routes: dict) -> None:
    """One line per backend and pattern: each route against contiguous, the faster, auto's."""
    for backend, patterns in routes.items():
        for pattern, entry in patterns.items():
            cells = ", ".join(f"{route} {entry[route]['vs_contiguous']:.2f}x "
                              f"({entry[route]['descriptors']} descriptors)"
                              for route in ("direct", "staged") if route in entry)
            print(f"{backend} {pattern}, against the contiguous request: {cells}; faster: "
                  f"{entry['faster']}; auto took {entry['auto']['route_taken']}: "
                  f"{entry['auto']['vs_contiguous']:.2f}x, {entry['auto_vs_faster']:.2f} of the "
                  f"faster")
