"""Validation of the launcher's options, before any pool is allocated or engine started.

One argparse ``type=`` function per kind of value (``positive_int``, ``timeout_seconds``,
``listen_endpoint``, ...): argparse names the option in its message. ``check_options`` then runs
the checks that need several options at once (pool size against page size and memory, the model
config, the listener's secret, Mooncake's IPv4) and raises ``OptionError`` naming the option.
``Parser`` prints every error on one line; either way the exit code is 2. ``fixed_port_warnings``
names the ports that options fix inside Mooncake's listener range (warned about, not refused).

Host names are resolved here, once, to a numeric address (IPv4 first: Mooncake takes nothing
else), so the engines and the control plane only ever see numbers.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import socket
from pathlib import Path

from .. import auth
from ..backends.environment import mooncake_port_warning
from ..control import parse_endpoint

MAX_REQUESTS = 1_000_000  # request lengths are drawn up front, one int64 each
MAX_LAYERS = 4096  # a layout holds one id per layer; real models have fewer than 200
MIN_QUARANTINE_S = 2.0  # decode's proof that a prefill's process is gone takes 1 s of refusals
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class OptionError(ValueError):
    """Options that do not go together; the message starts with the option's name."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``dsa-bridge decode: error: argument --x: ...``
    (subparsers inherit the class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def request_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_REQUESTS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_REQUESTS}, got {text!r}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def timeout_seconds(text: str) -> float:
    """Seconds: finite and > 0."""
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0, got {text!r}") from None


def quarantine_seconds(text: str) -> float:
    """``--quarantine-timeout``: seconds, finite and at least MIN_QUARANTINE_S (a shorter bound
    would end every quarantine before a gone prefill could be proven gone)."""
    value = timeout_seconds(text)
    if value < MIN_QUARANTINE_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_QUARANTINE_S:g} seconds, got {text!r}")
    return value


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def numeric_host(host: str) -> str:
    """``host`` as a numeric address: itself if it is one, else the first IPv4 address it
    resolves to, else its first IPv6 address."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        found = [info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(
            f"cannot resolve host {host!r}: {getattr(exc, 'strerror', None) or exc}") from None
    return next((a for a in found if ":" not in a), found[0])


def engine_host(text: str) -> str:
    return numeric_host(text.strip("[]"))


def _endpoint(text: str, lowest_port: int) -> str:
    try:
        host, port = parse_endpoint(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a numeric port, got {text!r}") from None
    if port < lowest_port:
        raise argparse.ArgumentTypeError(f"port must be in {lowest_port}..65535, got {text!r}")
    address = numeric_host(host)
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def listen_endpoint(text: str) -> str:
    """HOST:PORT to listen on (port 0: any free port), the host made numeric."""
    return _endpoint(text, 0)


def peer_endpoint(text: str) -> str:
    """HOST:PORT of a peer (port 1..65535), the host made numeric."""
    return _endpoint(text, 1)


def peer_endpoints(text: str) -> str:
    """One peer endpoint, or several separated by commas (pipeline stages), each made numeric."""
    return ",".join(peer_endpoint(part) for part in text.split(","))


def _writable_directory(directory: Path, label: str, not_a_directory: str) -> None:
    """``directory`` (``label`` in the messages) must be a directory we may write into;
    ``not_a_directory``: what the message says when it is not one."""
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"{label} {not_a_directory}")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{label} is not writable")


def output_file(text: str) -> str:
    """A file we will write: its directory must exist and be writable."""
    directory = Path(text).parent
    _writable_directory(directory, f"directory {str(directory)!r}", "does not exist")
    return text


def output_dir(text: str) -> str:
    """A directory we will create if needed and write into."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())
    _writable_directory(existing, repr(str(existing)), "is not a directory")
    return text


def secret_file(text: str) -> str:
    """A readable file whose first line is the shared secret."""
    try:
        auth.load_secret(text)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror}") from None
    except auth.AuthError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


ROOM_LIMIT = 2**63  # a room is a 63-bit number (vLLM's prefill draws them so)


def _room_entry(index: int, entry) -> tuple[int, int, dict]:
    """(room, prompt tokens, the entry) of one prefill answer, or ArgumentTypeError naming it."""
    if not isinstance(entry, dict):
        raise argparse.ArgumentTypeError(f"entry {index} must be an object, got {entry!r:.60}")
    values = []
    for key, low, high in (("remote_room", 0, ROOM_LIMIT - 1), ("remote_num_tokens", 1, None)):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"entry {index}: {key} must be an integer {bound}, "
                                             f"got {value!r:.60}")
        values.append(value)
    return values[0], values[1], entry


def rooms_file(text: str) -> list[tuple[int, int, dict]]:
    """``--rooms``: a JSON list of a prefill's answers, each with the ``remote_room`` and
    ``remote_num_tokens`` of vLLM's ``kv_transfer_params`` (other keys checked against the
    options later: ``check_rooms``); rooms unique. (room, tokens, entry) per answer."""
    try:
        entries = json.loads(Path(text).read_text())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror}") from None
    except (ValueError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(entries, list) or not entries or len(entries) > MAX_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"{text!r} must hold a JSON list of 1..{MAX_REQUESTS} prefill answers")
    rooms = [_room_entry(i, entry) for i, entry in enumerate(entries)]
    seen: set[int] = set()
    for index, (room, _, _) in enumerate(rooms):
        if room in seen:
            raise argparse.ArgumentTypeError(f"entry {index}: room {room} appears twice")
        seen.add(room)
    return rooms


def choice_list(choices: tuple[str, ...]):
    """A comma-separated list of some of ``choices`` (at least one)."""

    def parse(text: str) -> list[str]:
        chosen = [item for item in text.split(",") if item]
        if not chosen or set(chosen) - set(choices):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}, got {text!r}")
        return chosen

    return parse


# ---- checks across options (after parsing) -------------------------------------------------

def host_of(endpoint: str) -> str:
    return parse_endpoint(endpoint)[0]


def check_layout(args, make_layout) -> None:
    """--model (and the options ``make_layout(args) -> (config, layout)`` reads) describe a pool
    that can be built with --pool-tokens and, for the commands that allocate one, fits in this
    machine's memory."""
    from ...plugin import sizing
    from ...plugin.layout import load_model_config

    try:
        layers = load_model_config(args.model).get("num_hidden_layers")
        if isinstance(layers, int) and layers > MAX_LAYERS:  # before a layout of that size
            raise OptionError(f"num_hidden_layers is {layers}; at most {MAX_LAYERS} are supported")
        _, layout = make_layout(args)
    except ValueError as exc:
        raise OptionError(f"--model {args.model}: {exc}") from None
    if args.pool_tokens % args.page_size:
        raise OptionError(f"--pool-tokens must be a multiple of --page-size ({args.page_size}), "
                          f"got {args.pool_tokens}")
    pools = {"prefill": 1, "decode": 1, "demo": 2}.get(args.command, 0)
    need = pools * sizing.allocation_bytes(layout, args.pool_tokens)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        what = "two pools (prefill and decode) need" if pools == 2 else "the pool needs"
        raise OptionError(f"--pool-tokens {args.pool_tokens}: {what} {need / 2**30:.1f} GiB "
                          f"for {args.model} ({layout.num_layers} layers); this machine has "
                          f"{have / 2**30:.1f} GiB of memory")


def check_mooncake_ipv4(args, option: str, host: str) -> None:
    if args.backend == "mooncake" and ":" in host:
        raise OptionError(f"{option}: mooncake takes IPv4 addresses only, got {host}")


def check_options(args, make_layout) -> None:
    """Every check that needs more than one option; raises OptionError naming the option.
    ``make_layout(args) -> (config, layout)`` is the launcher's own."""
    if hasattr(args, "pool_tokens"):
        check_layout(args, make_layout)
    if args.command == "prefill":
        host = host_of(args.listen)
        check_mooncake_ipv4(args, "--listen", host)
        try:
            auth.check_listener(host, auth.load_secret(args.secret_file), args.insecure)
        except auth.AuthError as exc:
            raise OptionError(f"--listen {args.listen}: {exc}") from None
    if args.command == "decode":
        for endpoint in args.prefill.split(","):
            check_mooncake_ipv4(args, "--prefill", host_of(endpoint))
        if args.engine_host:
            check_mooncake_ipv4(args, "--engine-host", args.engine_host)
        if args.rooms is not None:
            check_rooms(args)


def fixed_port_warnings(args, env=os.environ) -> list[str]:
    """One warning per port the options fix (prefill's ``--listen``, ``--metrics-port``) inside
    Mooncake's listener range (``mooncake_port_warning``)."""
    fixed = []
    if getattr(args, "listen", None):
        fixed.append((f"--listen {args.listen}", parse_endpoint(args.listen, "--listen")[1]))
    if getattr(args, "metrics_port", 0):
        fixed.append((f"--metrics-port {args.metrics_port}", args.metrics_port))
    warnings = (mooncake_port_warning(option, port, env) for option, port in fixed)
    return [warning for warning in warnings if warning]


def check_rooms(args) -> None:
    """``--rooms`` against the other options: no ``--requests`` beside it, every prompt within
    the pool, and an answer's engine, endpoint and TP width (where it names them) the ones this
    decode node reads from: one prefill rank, at one of the ``--prefill`` endpoints."""
    if args.requests is not None:
        raise OptionError("--rooms: the requests are the file's; leave out --requests")
    endpoints = args.prefill.split(",")
    for index, (room, tokens, entry) in enumerate(args.rooms):
        where = f"--rooms: entry {index} (room {room})"
        if tokens > args.pool_tokens:
            raise OptionError(f"{where}: {tokens} prompt tokens do not fit --pool-tokens "
                              f"{args.pool_tokens}")
        engine = entry.get("remote_engine", args.backend)
        if engine != args.backend:
            raise OptionError(f"{where}: the prefill used engine {engine!r}, this node "
                              f"--backend {args.backend}")
        if entry.get("tp_size", 1) != 1:
            raise OptionError(f"{where}: the prefill has tp_size {entry['tp_size']!r}; this node "
                              "reads a request from one prefill rank (tp_size 1)")
        if "remote_host" in entry or "remote_port" in entry:
            try:
                named = peer_endpoint(f"{entry.get('remote_host')}:{entry.get('remote_port')}")
            except argparse.ArgumentTypeError as exc:
                raise OptionError(f"{where}: remote_host/remote_port: {exc}") from None
            if named not in endpoints:
                raise OptionError(f"{where}: the answer names prefill {named}, not one of "
                                  f"--prefill {args.prefill}")
