"""Hosts for multi-node tests: one network namespace per node, or plain loopback.

``Topology(count)`` makes a hub namespace holding a Linux bridge and, per node, a namespace with
loopback up and one end of a veth pair addressed ``10.203.<net>.<i>/24`` (the other end sits on
the hub's bridge). Every node reaches every other one by its own address; nothing is added to the
root namespace, and ``delete()`` removes every namespace it made (their veths go with them).
``unavailable()`` says why namespaces cannot be made here (not root, no iproute2, refused by the
kernel), so that the tier can skip with that reason and run the same scenarios on loopback.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

IP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Host:
    """Where one node runs: its address, its namespace (None on loopback) and its device."""

    name: str
    address: str
    netns: str | None = None
    device: str = "lo"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it in place, so the
        process started is the command itself and its PID is the one to stop)."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)

    def engine_env(self, backend: str) -> dict[str, str]:
        """What the engine needs on this host. In a namespace the address is not loopback, so the
        NIXL backend leaves UCX_NET_DEVICES unset; UCX would then move the data by shared memory
        (all processes share one kernel) and never touch the veth. Naming the veth and the tcp
        transport makes the bytes cross the namespace link, as they would between machines."""
        if backend == "nixl" and self.netns:
            return {"UCX_NET_DEVICES": self.device, "UCX_TLS": "tcp"}
        return {}

    def received_bytes(self) -> int:
        """Bytes received on this host's device (its veth; lo on loopback)."""
        out = _ip("-s", "-j", "link", "show", "dev", self.device, netns=self.netns)
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def _ip(*args: str, netns: str | None = None) -> str:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


@functools.cache
def unavailable() -> str | None:
    """None when this process can create network namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (no `ip` command)"
    probe = f"dsab-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", probe)
    return None


class Topology:
    """``count`` nodes, each in its own namespace, joined by a bridge in a hub namespace."""

    def __init__(self, count: int):
        tag = uuid.uuid4().hex[:6]
        self.net = 1 + int(tag, 16) % 250
        self.namespaces: list[str] = []
        self.hosts: list[Host] = []
        try:
            hub = self._add(f"dsab-{tag}-hub")
            _ip("link", "add", "br0", "type", "bridge", netns=hub)
            _ip("link", "set", "br0", "up", netns=hub)
            for i in range(1, count + 1):
                self.hosts.append(self._node(tag, hub, i))
        except BaseException:
            self.delete()
            raise

    def _add(self, name: str) -> str:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        return name

    def _node(self, tag: str, hub: str, i: int) -> Host:
        ns = self._add(f"dsab-{tag}-n{i}")
        device, peer = f"dsb{tag}n{i}", f"dsb{tag}h{i}"
        _ip("link", "add", device, "netns", ns, "type", "veth", "peer", "name", peer, "netns", hub)
        _ip("link", "set", peer, "master", "br0", "up", netns=hub)
        address = f"10.203.{self.net}.{i}"
        _ip("addr", "add", f"{address}/24", "dev", device, netns=ns)
        _ip("link", "set", device, "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        return Host(f"n{i}", address, ns, device)

    def delete(self) -> None:
        """Delete every namespace made here (best effort for each; the first error is raised)."""
        errors = []
        for ns in reversed(self.namespaces):
            try:
                _ip("netns", "del", ns)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self.namespaces.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


def loopback_hosts(count: int) -> list[Host]:
    return [Host(f"n{i}", "127.0.0.1") for i in range(1, count + 1)]
