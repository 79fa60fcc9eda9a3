"""Local mode as a cloud group with `--surplus`: the launcher says which nodes the
agents released (agents/release.py), and when the job asks for more nodes than
it holds, it starts each missing one `--acquire-seconds` later, as a group grows
back after a release or a preemption. A newcomer takes a fresh node id (never a
released or dead node's) in the zone with the fewest live nodes, and waits in
standby until the next configuration places it.
"""
from __future__ import annotations

import sys
import time

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import DRAIN, FAILED, IDS, MEMBERS, RELEASES


class Regrow:
    def __init__(self, launcher, agent_module: str):
        self.launcher, self.agent = launcher, agent_module
        self.said: set[int] = set()      # released nodes already printed
        self.due: list[float] = []       # when each node asked for is started (monotonic seconds)
        self.started: dict[int, str] = {}  # node -> zone of the newcomers started here

    def tick(self, cluster: Cluster) -> None:
        decisions = cluster.children(RELEASES())
        if not decisions:
            return
        newest = decisions[max(decisions)]
        for decision in decisions.values():
            for node in sorted(set(decision.nodes) - self.said):
                self.said.add(node)
                print(f"bamboo-train: node {node} released: in no pipeline, beyond the {decision.standby} standby "
                      f"the burst rule keeps", file=sys.stderr, flush=True)
        now = time.monotonic()
        for _ in [t for t in self.due if t <= now]:
            self.due.remove(min(self.due))
            self._start_one(cluster)
        missing = newest.desired - self._held(cluster) - len(self.due)
        if missing > 0:
            wait = self.launcher.cfg.cluster.acquire_seconds
            print(f"bamboo-train: the job asks for {newest.desired} nodes: {missing} more in {wait:g} s "
                  "(--acquire-seconds)", file=sys.stderr, flush=True)
            self.due += [now + wait] * missing

    def _held(self, cluster: Cluster) -> int:
        """Nodes whose agent runs and that are neither dead nor leaving."""
        gone = set(cluster.children(FAILED())) | set(cluster.children(DRAIN()))
        return sum(p.poll() is None and k not in gone for k, p in self.launcher.procs.items())

    def _start_one(self, cluster: Cluster) -> None:
        local = self.launcher.local
        node = max({*cluster.children(IDS()), *self.launcher.procs}) + 1  # ids are never reused
        zones = {n: m.zone for n, m in cluster.children(MEMBERS()).items()}
        zones.update({n: z for n, z in self.started.items() if n not in zones})  # not registered yet
        gone = set(cluster.children(FAILED())) | set(cluster.children(DRAIN()))
        load = {zone: 0 for zone in local.zones}
        for n, zone in zones.items():
            if n not in gone and zone in load:
                load[zone] += 1
        zone = min(local.zones, key=lambda z: (load[z], local.zones.index(z)))
        args = local.agent_args(node)
        args[args.index("--zone") + 1] = zone
        self.started[node] = zone
        print(f"bamboo-train: node {node} starts in zone {zone}, asked for by the job", file=sys.stderr, flush=True)
        self.launcher._start(cluster, node, self.agent, *args, "--log-dir", self.launcher.logs)
