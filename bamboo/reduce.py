"""Data parallelism: sum each stage's gradients over the D pipelines.

The group of a stage is its current owner in every pipeline (after a failure, the
predecessor that took the stage over). A reduce that fails because a member died
waits until that death is recorded and retries in the group of the new owners,
from an untouched copy of the local gradients. A member that finished a reduce
and then died took part of the sum with it: that case is refused, by name.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from schedules.layout import Layout, ScheduleError

from bamboo.cluster import Cluster
from bamboo.executor import flat_grads, set_flat_grads
from bamboo.failover import Unsurvivable
from bamboo.store import EtcdStore


class Reducer:
    def __init__(self, cluster: Cluster, stages: int, pipelines: int, me: int, timeout: float):
        self.cluster, self.P, self.D, self.me, self.timeout = cluster, stages, pipelines, me, timeout
        self._groups: dict[tuple[int, ...], tuple] = {}

    def members(self, stage: int) -> tuple[int, ...]:
        failed = {int(n) for n in self.cluster.children("failed")}
        out = []
        for j in range(self.D):
            local = frozenset(n - j * self.P for n in failed if j * self.P <= n < (j + 1) * self.P)
            try:
                out.append(j * self.P + Layout(self.P, local).owner(stage))
            except ScheduleError as e:
                raise Unsurvivable(f"pipeline {j}: {e}") from None
        return tuple(out)

    def _group(self, stage: int, members: tuple[int, ...]):
        if members not in self._groups:
            prefix = self.cluster.key("pg", f"stage{stage}", "-".join(map(str, members)))
            store = EtcdStore(self.cluster.client, prefix, timedelta(seconds=max(60.0, 10 * self.timeout)))
            pg = dist.ProcessGroupGloo(store, members.index(self.me), len(members), timedelta(seconds=300))
            self._groups[members] = (store, pg)
        return self._groups[members][1]

    def allreduce(self, iteration: int, stage: int, module, failover) -> None:
        if self.D == 1:
            return
        while True:
            members = self.members(stage)
            done = self.cluster.get("reduced", iteration, stage)
            if done is not None and tuple(done) != members:
                raise Unsurvivable(f"a node died after its data-parallel reduce of stage {stage} in iteration "
                                   f"{iteration} and before syncing its replica: its share of the sum is lost")
            flat = flat_grads(module)
            try:
                self._group(stage, members).allreduce([flat]).wait()
                break
            except RuntimeError:
                self.cluster.wait_for(lambda: self.members(stage) != members, timeout=max(60.0, 20 * self.timeout),
                                      what=f"the failed member of stage {stage}'s group to be recorded", poll=0.05)
        set_flat_grads(module, flat)
        self.cluster.put(list(members), "reduced", iteration, stage)
