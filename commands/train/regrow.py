"""Local mode as a cloud group with `--surplus`: the launcher says which nodes the
agents released (agents/release.py), and when the job asks for more nodes than
it holds, it starts each missing one `--acquire-seconds` later, as a group grows
back after a release or a preemption. A newcomer claims a fresh node id itself
(never a released or dead node's), in the zone with the fewest live nodes, and
waits in standby until the next configuration places it.
"""
from __future__ import annotations

import sys
import time

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import DRAIN, FAILED, MEMBERS, RELEASES

FIRST_KEY = 1_000_000  # the launcher's keys of newcomers' processes (their node ids are their own)


class Regrow:
    def __init__(self, launcher, agent_module: str):
        self.launcher, self.agent = launcher, agent_module
        self.read = -1                   # the newest epoch whose decision was read (its releases printed)
        self.due: list[float] = []       # when each node asked for is started (monotonic seconds)
        self.started: dict[int, str] = {}  # the launcher's key -> zone of each newcomer started here

    def tick(self, cluster: Cluster) -> None:
        decisions = cluster.children(RELEASES())
        if not decisions:
            return
        newest = decisions[max(decisions)]
        for epoch in sorted(e for e in decisions if e > self.read):
            for node in decisions[epoch].nodes:
                print(f"bamboo-train: node {node} released: in no pipeline, beyond the {decisions[epoch].standby} "
                      f"standby --surplus {self.launcher.cfg.cluster.surplus} keeps", file=sys.stderr, flush=True)
        self.read = max(decisions)
        gone = set(cluster.children(FAILED())) | set(cluster.children(DRAIN()))  # dead or leaving
        now = time.monotonic()
        for _ in [t for t in self.due if t <= now]:
            self.due.remove(min(self.due))
            self._start_one(cluster, gone)
        # at most the nodes this launcher started with: a decision from etcd is checked for its types only
        most = self.launcher.local.nodes + sum(count for count, _ in self.launcher.local.joins)
        missing = min(newest.desired, most) - self._held(gone) - len(self.due)
        if missing > 0:
            wait = self.launcher.cfg.cluster.acquire_seconds
            print(f"bamboo-train: the job asks for {newest.desired} nodes: {missing} more in {wait:g} s "
                  "(--acquire-seconds)", file=sys.stderr, flush=True)
            self.due += [now + wait] * missing

    def _held(self, gone: set[int]) -> int:
        """Nodes whose agent runs and that are not `gone` (a newcomer's id is not
        known here: it counts while its agent runs)."""
        return sum(p.poll() is None and (k in self.started or k not in gone)
                   for k, p in self.launcher.procs.items())

    def _start_one(self, cluster: Cluster, gone: set[int]) -> None:
        local = self.launcher.local
        key = FIRST_KEY + len(self.started)
        load = {zone: 0 for zone in local.zones}
        for n, member in cluster.children(MEMBERS()).items():
            if n not in gone and member.zone in load:
                load[member.zone] += 1
        for k, zone in self.started.items():  # newcomers count where they start (a registered one twice: a bias only)
            if self.launcher.procs[k].poll() is None and zone in load:
                load[zone] += 1
        zone = min(local.zones, key=lambda z: (load[z], local.zones.index(z)))
        args = local.agent_args(key)
        args[args.index("--zone") + 1] = zone
        self.started[key] = zone
        print(f"bamboo-train: a node starts in zone {zone}, asked for by the job", file=sys.stderr, flush=True)
        self.launcher._start(cluster, key, self.agent, *args, "--log-dir", self.launcher.logs, named=False)
