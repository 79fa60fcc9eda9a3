"""Machines that vanish, on one Linux box: each node of a local job in its own
network namespace, with its own address on one bridge, and etcd in another.

On loopback a killed process's sockets close at once and its peers see a reset.
A preempted spot VM closes nothing: its packets stop. `NetLab` makes that happen
to a node: `cut` sets its link down (packets to and from it go nowhere, no FIN,
no RST), `heal` brings the link back, `block` loses the traffic between two
machines only (a node that cannot reach etcd while its peers can). Freezing
its processes (SIGSTOP) with the cut is a vanish; that is the caller's part.

Needs root and iproute2 (`ip netns`); `unavailable()` says why not, in one line.
"""
from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass

INSIDE = "eth0"  # every namespace names its end of the link alike: gloo binds to it (GLOO_SOCKET_IFNAME)
NOWHERE_MAC = "02:00:00:00:00:01"  # a locally administered MAC that no machine of a lab has


@dataclass(frozen=True)
class Machine:
    name: str       # the lab's name for it ("etcd", "n3", ...)
    netns: str      # its network namespace
    address: str    # its address on the bridge
    link: str       # the host end of its veth pair, on the bridge: down is a cut cable


def unavailable() -> str | None:
    """Why this box cannot build a lab (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"bbp{os.getpid() % 10 ** 7}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    made = subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a bridge: {made.stderr.strip()}"
    subprocess.run(["ip", "link", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class NetLab:
    """A bridge and the namespaces on it; `close()` removes everything it made."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"{random.randrange(16 ** 4):04x}"
        self.bridge = f"bb{self.tag}"
        tag = int(self.tag, 16)
        self.net = ipaddress.ip_network(f"10.{100 + (tag >> 8) % 100}.{tag % 254 + 1}.0/24")  # one of 25,400
        self.gateway = str(self.net[1])  # the bridge's own address: this namespace reaches every machine
        self.machines: dict[str, Machine] = {}
        self.nowhere = str(self.net[-2])  # an address no machine has: what `block` routes into

    def start(self) -> "NetLab":
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Machine:
        """A new machine: a namespace, its loopback, and a link to the bridge."""
        index = len(self.machines) + 2
        if self.net[index] >= ipaddress.ip_address(self.nowhere):
            raise RuntimeError(f"a lab holds at most {index - 2} machines")
        m = Machine(name, f"{self.bridge}-{name}", str(self.net[index]), f"{self.bridge}v{index}")
        _ip("netns", "add", m.netns)
        self.machines[name] = m
        _ip("link", "add", m.link, "type", "veth", "peer", "name", INSIDE, "netns", m.netns)
        _ip("link", "set", m.link, "master", self.bridge, "up")
        _ip("-n", m.netns, "addr", "add", f"{m.address}/{self.net.prefixlen}", "dev", INSIDE)
        _ip("-n", m.netns, "link", "set", INSIDE, "up")
        _ip("-n", m.netns, "link", "set", "lo", "up")
        return m

    def command(self, name: str) -> list[str]:
        """The prefix that runs a command on machine `name`."""
        return ["ip", "netns", "exec", self.machines[name].netns, "env", f"GLOO_SOCKET_IFNAME={INSIDE}"]

    def cut(self, name: str) -> None:
        """Pull the machine's cable: nothing in or out, and nobody is told."""
        _ip("link", "set", self.machines[name].link, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.machines[name].link, "up")

    def block(self, a: str, b: str) -> None:
        """Lose what `a` and `b` send each other, both ways, silently (the rest
        flows): each routes the other's address through a neighbour that is not
        there, a permanent entry with a MAC no machine has, so its frames go out
        and nobody takes them (no error comes back, as from a black hole route)."""
        ma, mb = self.machines[a], self.machines[b]
        for src, dst in ((ma, mb), (mb, ma)):
            _ip("-n", src.netns, "neigh", "replace", self.nowhere, "lladdr", NOWHERE_MAC, "nud", "permanent",
                "dev", INSIDE)
            _ip("-n", src.netns, "route", "add", f"{dst.address}/32", "via", self.nowhere, "dev", INSIDE)

    def unblock(self, a: str, b: str) -> None:
        ma, mb = self.machines[a], self.machines[b]
        for src, dst in ((ma, mb), (mb, ma)):
            _ip("-n", src.netns, "route", "del", f"{dst.address}/32", "via", self.nowhere, "dev", INSIDE)

    def close(self) -> None:
        for m in self.machines.values():
            subprocess.run(["ip", "netns", "del", m.netns], capture_output=True)  # its veth pair goes with it
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.machines.clear()

    def __enter__(self) -> "NetLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
