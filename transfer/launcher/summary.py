"""Run summaries: written atomically as JSON for other processes, joined, printed for people.

Where a run's time goes, as the summary reports it (bytes are always the verified bytes):

- ``gbps`` over ``transfer_seconds``: wall time during which at least one request was between
  prefill having its pages ready and decode's Success (control messages, planning, queueing at
  the writer, the engine's writes, the completion report): dsa-bridge's transfer;
- ``engine_gbps``: over the seconds the engine's write calls took, summed;
- ``fill_gbps`` over ``fill_seconds``: the prefill's stand-in model filling the pages with the
  test pattern before it hands them over (a real prefill computes them instead);
- ``request_gbps`` over ``request_seconds``: from decode's request (``init``) to Success, the
  stand-in's filling and waiting included;
- ``verify_gbps`` over ``verify_seconds``: decode checking every received byte against the
  pattern and refilling released pages with the sentinel (the test's own work; while it runs,
  decode starts no new request).

Decode alone knows neither when prefill's pages were ready nor how long filling took: those
four keys are null in ``dsa-bridge decode``'s summary. ``dsa-bridge demo`` fills them in from the
summary the prefill process writes at exit (``join_prefill``); both processes run on one
machine there, so their ``time.monotonic()`` readings come from one clock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(data, out)
    os.replace(tmp, path)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Wall time covered by at least one of the ``(start, stop)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def join_prefill(summary: dict, prefill: dict) -> dict:
    """Decode's summary (with its ``request_times``: room -> [init, Success]) completed with what
    the prefill process reported (``ready_at``: room -> time its pages were ready; fill totals;
    its counters, as ``prefill_counters``). The transfer figures stay null unless prefill's ready
    time of every timed request is known."""
    joined = {key: value for key, value in summary.items() if key != "request_times"}
    joined["fill_seconds"] = round(prefill["fill_seconds"], 3)
    joined["fill_gbps"] = round(gbps(prefill["fill_bytes"], prefill["fill_seconds"]), 3)
    joined["prefill_counters"] = prefill["counters"]
    times = summary["request_times"]
    ready = prefill["ready_at"]
    if times and set(times) <= set(ready):
        seconds = busy_seconds((ready[room], done) for room, (_, done) in times.items())
        joined["transfer_seconds"] = round(seconds, 3)
        joined["gbps"] = round(gbps(summary["bytes_verified"], seconds), 3)
    return joined


def print_summary(summary: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    verdict = "OK" if summary["ok"] else "FAILED"
    lines = [f"{verdict}: {summary['requests_ok']}/{summary['requests']} requests, "
             f"{summary['bytes_verified'] / 1e9:.2f} GB verified byte-exact over "
             f"{summary['layers']} layers' MLA KV and {summary['indexer_layers']} layers' indexer "
             f"({summary['backend']} over "
             f"{summary['transport']}, {summary['seconds']:.1f}s in all)"]
    if summary["gbps"] is not None:
        lines.append(f"  transfer  {summary['gbps']:.2f} GB/s from prefill's pages ready to "
                     f"decode's Success ({summary['transfer_seconds']:.2f}s busy)")
    lines.append(f"  engine    {summary['engine_gbps']:.2f} GB/s inside the engine's writes")
    if summary["fill_gbps"] is not None:
        lines.append(f"  stand-in  {summary['fill_gbps']:.2f} GB/s prefill's stand-in model filling "
                     f"the pages ({summary['fill_seconds']:.2f}s), not part of the transfer")
    lines.append(f"  requests  {summary['request_gbps']:.2f} GB/s from decode's request to "
                 f"Success ({summary['request_seconds']:.2f}s busy), prefill's filling included")
    lines.append(f"  checking  {summary['verify_gbps']:.2f} GB/s decode checking every byte and "
                 f"resetting pages ({summary['verify_seconds']:.2f}s), not part of the transfer")
    if summary.get("checksums"):
        lines.append(f"  checksums {summary['checksums_verified']} page checksums verified end to end")
    lines += [f"  failed: {failure}" for failure in summary["failures"]]
    print("\n".join(lines), flush=True)
