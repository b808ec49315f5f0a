"""``dsa-bridge demo``: a real prefill process and a real decode process on this machine.

The demo starts ``dsa-bridge prefill`` on a free loopback port, waits until it is listening,
then runs ``dsa-bridge decode`` against it, which drives the requests and verifies every byte.
Both children are stopped by PID whatever happens; the children's stdout (where NIXL and UCX
log) goes to our stderr, so ``--json`` prints nothing but the summary. Decode's summary is
completed with the one prefill writes when it stops (when each request's pages were ready, how
long the stand-in model took to fill them): ``summary.join_prefill``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from .summary import join_prefill, print_summary


def node_arguments(args) -> list[str]:
    arguments = ["--model", args.model, "--indexer-layout", args.indexer_layout,
                 "--page-size", str(args.page_size), "--pool-tokens",
                 str(args.pool_tokens), "--backend", args.backend, "--peer-timeout",
                 str(args.peer_timeout), "--request-timeout", str(args.request_timeout)]
    if args.kv_dtype:
        arguments += ["--kv-dtype", args.kv_dtype]
    if args.secret_file:
        arguments += ["--secret-file", args.secret_file]
    if args.checksums:
        arguments.append("--checksums")
    if args.staging_mib is not None:
        arguments += ["--staging-mib", str(args.staging_mib)]
    if args.verbose:
        arguments.append("--verbose")
    return arguments


def launch(role: str, arguments: list[str], log_level: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "--log-level", log_level, role]
    return subprocess.Popen(command + arguments, stdout=sys.stderr, stdin=subprocess.DEVNULL)


def wait_ready(process: subprocess.Popen, path: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as ready:
                return json.load(ready)
        if process.poll() is not None:
            raise RuntimeError(f"prefill exited with code {process.returncode} before listening")
        time.sleep(0.05)
    raise RuntimeError(f"prefill was not listening within {timeout_s:.0f}s")


def stop(process: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def run_demo(args) -> int:
    prefill = decode = None
    with tempfile.TemporaryDirectory(prefix="dsa-bridge-demo-") as tmp:
        ready_file = os.path.join(tmp, "prefill.json")
        prefill_file = os.path.join(tmp, "prefill-summary.json")
        summary_file = os.path.join(tmp, "summary.json")
        try:
            prefill = launch("prefill", ["--listen", "127.0.0.1:0", "--ready-file", ready_file,
                                         "--summary-file", prefill_file, *node_arguments(args)],
                             args.log_level)
            endpoint = wait_ready(prefill, ready_file, timeout_s=120)["endpoint"]
            decode = launch("decode", [
                "--prefill", endpoint, "--summary-file", summary_file, "--requests",
                str(args.requests), "--concurrency", str(args.concurrency), "--max-tokens",
                str(args.max_tokens), "--seed", str(args.seed), *node_arguments(args),
            ], args.log_level)
            decode.wait(args.timeout)
        except subprocess.TimeoutExpired:
            print(f"dsa-bridge demo: no result within {args.timeout:.0f}s", file=sys.stderr)
            return 1
        finally:
            stop(decode)
            stop(prefill)
        if not os.path.exists(summary_file):
            print(f"dsa-bridge demo: decode exited with code {decode.returncode} and no summary",
                  file=sys.stderr)
            return 1
        with open(summary_file) as f:
            summary = json.load(f)
        if os.path.exists(prefill_file):
            with open(prefill_file) as f:
                summary = join_prefill(summary, json.load(f))
        else:
            summary.pop("request_times")
            print(f"dsa-bridge demo: prefill exited with code {prefill.returncode} and no "
                  "summary: no transfer or fill figures", file=sys.stderr)
    print_summary(summary, as_json=args.json)
    return 0 if summary["ok"] and decode.returncode == 0 else 1
