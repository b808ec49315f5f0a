"""Run summaries: written atomically as JSON for other processes, printed for people."""

from __future__ import annotations

import json
import os


def write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(data, out)
    os.replace(tmp, path)


def print_summary(summary: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    verdict = "OK" if summary["ok"] else "FAILED"
    print(f"{verdict}: {summary['requests_ok']}/{summary['requests']} requests, "
          f"{summary['bytes_verified'] / 1e9:.2f} GB verified byte-exact over "
          f"{summary['layers']} layers' MLA KV and {summary['indexer_layers']} layers' indexer; "
          f"{summary['gbps']:.2f} GB/s while "
          f"transferring, {summary['engine_gbps']:.2f} GB/s inside the engine "
          f"({summary['backend']} over {summary['transport']}, {summary['seconds']:.1f}s in all)",
          flush=True)
    for failure in summary["failures"]:
        print(f"  failed: {failure}", flush=True)
