"""The agents' part of the job's etcd state: which nodes exist, in which zones, and
which configuration runs next. Keys, under /bamboo/<job>/ (next to the workers'
keys listed in bamboo/cluster.py):

    ids/<id>              claimed once by the agent that takes node id <id> (never reused)
    members/<id>          {"zone", "host"} under the agent's lease: the node exists
    zones/<id>            the node's zone, kept after it is gone (for status and traces)
    drain/<id>            the node asked to leave (SIGTERM, preemption notice)
    notices/<id>          {"source", "action", "time"}: the cloud's preemption notice
    assignment/<epoch>    the configuration of an epoch: {"epoch", "start", "pipelines",
                          "standby", "failed", "restore"}; created if absent, so for any
                          epoch exactly one agent's decision stands
    regroup/<it>/<try>    (written by the workers) {"failed", "reconfigure"}: the
                          workers ask for a new configuration before iteration it + 1

Any agent may decide: each reads the same keys and runs the same pure policy, and
the create-if-absent write of the next epoch lets exactly one decision stand.
"""
from __future__ import annotations

import json
import socket
import threading
import time

from agents.policy import Config, next_config
from bamboo.assignment import Assignment, latest_assignment
from bamboo.checkpoint import latest, storage_for
from bamboo.cluster import Cluster
from bamboo.config import JobConfig


def to_policy(a: Assignment) -> Config:
    return Config(a.epoch, a.depth, tuple(tuple(str(n) for n in p) for p in a.pipelines),
                  tuple(str(n) for n in a.standby))


def from_policy(c: Config, start: int, failed, gone=None, restore: str = "peers") -> Assignment:
    failed = tuple(sorted(int(n) for n in failed))
    return Assignment(c.epoch, start, tuple(tuple(int(n) for n in p) for p in c.pipelines),
                      tuple(int(n) for n in c.standby), failed,
                      failed if gone is None else tuple(sorted(int(n) for n in gone)), restore)


# Keys of one iteration's attempt: cleared when the iteration (or a checkpoint's
# span) is run again.
ITERATION_KEYS = ("done", "loss", "finished", "cut", "reduced", "regroup", "abort", "aborted")


class Membership:
    def __init__(self, cluster: Cluster, zone: str, node: int | None, ttl: float):
        self.cluster, self.zone = cluster, zone
        self.node = node if node is not None else self._claim_id()
        if node is not None and not cluster.create(True, "ids", node):
            raise ValueError(f"node id {node} is taken in this job")
        cluster.put(zone, "zones", self.node)
        self.lease = cluster.client.lease(max(1, int(round(ttl))))
        cluster.client.put(cluster.key("members", self.node),
                           json.dumps({"zone": zone, "host": socket.gethostname()}), lease=self.lease)
        self._stop = threading.Event()
        threading.Thread(target=self._refresh, args=(ttl,), daemon=True, name="membership").start()
        self._drained = False
        self._epoch: int | None = None  # the newest assignment seen
        self._next = 0                  # the first iteration whose regroup records are not settled

    def _claim_id(self) -> int:
        n = len(self.cluster.children("ids"))
        while not self.cluster.create(True, "ids", n):
            n += 1
        return n

    def _refresh(self, ttl: float) -> None:
        while not self._stop.wait(max(0.2, ttl / 3)):
            try:
                self.lease.refresh()
            except Exception:  # etcd briefly unreachable: the next round tries again
                continue

    def live(self, exclude=()) -> dict[str, str]:
        """node -> zone of the registered nodes, without `exclude` and the draining."""
        out = {n: v["zone"] for n, v in self.cluster.children("members").items()}
        gone = {str(n) for n in exclude} | set(self.cluster.children("drain"))
        return {n: z for n, z in out.items() if n not in gone}

    def first_assignment(self, nodes: list[int]) -> None:
        """Run by the rendezvous' rank 0: assignment 0 over the nodes that met."""
        zones = {int(n): z for n, z in self.cluster.children("zones").items()}
        live = {str(n): zones[n] for n in nodes}
        cfg = JobConfig.from_dict(self.cluster.get("config"))
        self.cluster.create(from_policy(next_config(live, None, cfg.stages), 0, ()).to_dict(), "assignment", 0)

    def decide(self, cfg: JobConfig) -> None:
        """If the workers asked for a new configuration after some iteration, or
        abandoned one, and none exists yet, write it (first writer wins)."""
        if not self.cluster.children("assignment"):
            return
        latest = latest_assignment(self.cluster)
        if latest.epoch != self._epoch:  # a new epoch: what came before it is settled
            self._epoch, self._next = latest.epoch, latest.start
        aborted = self.cluster.children("abort")
        if aborted:
            self._redo(cfg, latest, min(int(k) for k in aborted))
            return
        while True:
            tries = self.cluster.children("regroup", self._next)
            if not tries:
                return
            asked = [r for r in tries.values() if r["reconfigure"]]
            if asked and self._next + 1 < cfg.iterations:
                previous = latest_assignment(self.cluster)
                if previous.start <= self._next:
                    failed = asked[0]["failed"]
                    self._next_epoch(cfg, previous, self._next, failed, failed, redo=False)
            if not self.cluster.children("regroup", self._next + 1):
                return  # this iteration may still get another try
            self._next += 1

    def _redo(self, cfg: JobConfig, previous: Assignment, it: int) -> None:
        """Iteration `it` was abandoned. Once every live node has undone its steps,
        configure the survivors to redo it from their copies, or, when a stage has
        no copy left on any node, from the newest complete checkpoint. (Another
        agent may get there first: its transaction then clears what this one read.)"""
        acked = {int(n) for n in self.cluster.children("aborted", it)}
        failed = {int(n) for n in self.cluster.children("failed")}
        waiting = [n for n in previous.members if n not in failed and n not in acked]
        if waiting:  # a node that died without a record would hold everyone up
            self.cluster.record_silent(waiting, it, self.node)
            return
        if it > previous.start:  # the failures the nodes' layers reflect at the start of `it`
            tries = self.cluster.children("regroup", it - 1)
            if not tries:
                return  # cleared: another agent decided
            before = tries[max(tries, key=int)]["failed"]
        else:
            before = previous.gone
        self._next_epoch(cfg, previous, it, before, failed, redo=True)

    def _next_epoch(self, cfg: JobConfig, previous: Assignment, it: int, before, failed, redo: bool) -> None:
        """Write the epoch after iteration `it` (before it, with `redo`): the policy
        over the live nodes; layers from the survivors, whose holdings reflect the
        failures `before`, or, when some stage is held by no live node, from the
        newest complete checkpoint (the iterations after it are run again)."""
        config = next_config(self.live(failed), to_policy(previous), cfg.stages)
        if config.depth < 2:
            return  # a pipeline needs two nodes: wait for more (the workers wait for this epoch)
        held = {s for n, stages in previous.holders(before, cfg.redundancy).items() if n not in set(failed)
                for s in stages}
        start, restore = (it if redo else it + 1), "peers"
        if len(held) < previous.depth:
            start, restore, redo = self._checkpoint_iteration(cfg, it), "checkpoint", True
        new = from_policy(config, start, before, failed, restore)
        new = Assignment(**{**new.__dict__, "redo": redo})
        clear = [(family, k) for family in ITERATION_KEYS for k in range(start, it + 1)]
        self.cluster.create_clearing(new.to_dict(), ("assignment", new.epoch), clear)

    @staticmethod
    def _checkpoint_iteration(cfg: JobConfig, it: int) -> int:
        """The iteration of the newest complete checkpoint, which the workers then
        load by name (`it` if there is none: they stop with that error)."""
        if not cfg.checkpoint:
            return it
        found = latest(storage_for(cfg.checkpoint), cfg.layers)
        return found[0] if found else it

    def drain(self) -> None:
        if not self._drained:
            self.cluster.put(time.time(), "drain", self.node)
            self._drained = True

    def job_finished(self) -> bool:
        cfg = self.cluster.get("config")
        return bool(self.cluster.children("done", cfg["iterations"] - 1))

    def leave(self) -> None:
        self._stop.set()
        try:
            self.lease.revoke()
        except Exception:  # etcd gone: the lease expires on its own
            pass
