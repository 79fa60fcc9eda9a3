"""The surplus rule at run time: which of an epoch's nodes in no pipeline the job
keeps as warm standby and which it gives back, decided once per epoch by the
first agent to write it, with the same pure functions the simulator runs
(agents/surplus.py).

The standby is the burst rule's count (`BurstModel.standby`), each node of it
kept only while it earns its price (`Economics`, the simulator's weighing, here
with the throughputs the policy's own stage-slot estimate gives the pipelines
left after each loss): bursts are the job's recorded deaths grouped by the
iteration they happened in, observed since the job's first decision (a time in
the decisions, so every writer divides by the same span), from auto's prior
(--auto-prior-rate, --auto-prior-hours). The nodes
the job asks for (its group's desired capacity) stand through a preemption, so a
lost node is replaced; a release lowers them. While fewer nodes are held than
asked for, the nodes in no pipeline wait for the newcomers instead of going.

A released node's agent drains (it holds no stage) and exits with RELEASED; on a
cloud, cloud/node_exit.py then takes its machine out of the group, one smaller;
locally, the launcher prints it and starts a newcomer when the job asks for more.
"""
from __future__ import annotations

import time
from typing import Callable

from agents.policy import Priced, next_config, slot_estimate
from agents.surplus import BurstModel, Economics, SurplusRule, assign_surplus, burst_order, standby_count
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster, latest
from bamboo.control.config import JobConfig
from bamboo.control.protocol import ASSIGNMENT, RELEASES, Release

LOOK_EVERY = 0.5  # seconds between an agent's reads of the newest epoch


def bursts(failed: dict) -> tuple[int, ...]:
    """The job's recorded deaths as bursts: how many died in each iteration."""
    by_iteration: dict[int, int] = {}
    for failure in failed.values():
        by_iteration[failure.iteration] = by_iteration.get(failure.iteration, 0) + 1
    return tuple(by_iteration[it] for it in sorted(by_iteration))


def decide_release(cfg: JobConfig, epoch: Assignment, live: dict[str, str], previous: Release | None,
                   bursts_seen: tuple[int, ...], now: float, shared: frozenset[str] = frozenset()) -> Release:
    """The decision for `epoch` over the `live` nodes (node -> zone) at `now` (epoch
    seconds): the standby the rule asks for, up to the group's first size (more
    are asked for when too few are idle); the nodes in no pipeline beyond it go,
    unless fewer are held than asked for (they wait for the newcomers). Only the
    epoch's own nodes count: one that joined after it was made waits for the next
    epoch. Nodes the previous decision released are gone, whether or not they have
    left yet. A node
    of a machine of several workers (`shared`) is never released: the machine
    leaves whole or not at all."""
    # a node that joined after the epoch was made waits for the next one to place it: neither held nor idle yet
    live = {n: z for n, z in live.items() if int(n) in epoch.members or int(n) in epoch.standby}
    if previous is not None:
        live = {n: z for n, z in live.items() if int(n) not in previous.nodes}
    trainers = {str(n): live[str(n)] for pipe in epoch.pipelines for n in pipe if str(n) in live}
    idle = {n: z for n, z in live.items() if n not in trainers}
    ceiling, since = (len(live), now) if previous is None else (previous.ceiling, previous.since)
    seen = BurstModel.seen(bursts_seen, max(0.0, now - since), len(trainers), cfg.schedule.auto_prior_rate,
                           cfg.schedule.auto_prior_hours)
    keep = standby_count(SurplusRule(cfg.cluster.surplus), seen,
                         cfg.cluster.acquire_seconds, cfg.cluster.standby_epsilon, len(trainers),
                         max(len(idle), ceiling - len(trainers)), economics(cfg, epoch, trainers, len(live)),
                         fixed=cfg.cluster.fixed_standby)
    desired = max(len(live) if previous is None else previous.desired, len(trainers) + keep)
    if len(live) < desired:
        return Release((), keep, desired, ceiling, since)
    gone = assign_surplus({n: z for n, z in idle.items() if n not in shared}, trainers, keep).release
    return Release(tuple(int(n) for n in gone), keep, desired - len(gone), ceiling, since)


def economics(cfg: JobConfig, epoch: Assignment, trainers: dict[str, str], paid: int) -> Economics:
    """What a standby earns: the iteration rate of the epoch's pipelines, and of the
    policy's configuration with its first j `trainers` gone as a burst takes them,
    from the stage-slot estimate the policy places pipelines by (the samples of an
    iteration are the same in each, so its rate measures throughput)."""
    s = cfg.schedule
    estimate, order = slot_estimate(s.microbatches), burst_order(trainers)

    def rate(gone: int) -> float:
        if gone == 0:
            pipelines = [tuple(str(n) for n in pipe) for pipe in epoch.pipelines]
        else:
            config = next_config({n: trainers[n] for n in order[gone:]}, None, s.stages, s.microbatches,
                                 s.max_stages_per_node, estimate, priced=Priced(per_node=True))
            pipelines = list(config.pipelines) if config.depth == s.stages else []
        return 1.0 / estimate(pipelines) if pipelines else 0.0
    return Economics(rate, paid)


class Releaser:
    """One agent's part: decide an epoch's release if no agent has yet, and say
    whether its own node is released."""

    def __init__(self, cluster: Cluster, cfg: JobConfig, hosts: Callable[[], dict[str, str]] = dict):
        self.cluster, self.cfg, self.hosts = cluster, cfg, hosts  # hosts(): node -> machine, of shared machines
        self.decided = -1               # the newest epoch whose decision this agent has read ...
        self.decision: Release | None = None  # ... and that decision
        self.grown: int | None = None   # nodes asked for beyond the last decision's, by a decision this agent wrote
        self.looked = 0.0               # when etcd was last read (at most twice a second: agents step every 50 ms)

    def step(self, live: Callable[[], dict[str, str]]) -> Release | None:
        """The newest epoch's decision, written now over the `live()` nodes if absent
        (None: keep every node, or no epoch yet)."""
        now = time.monotonic()
        if self.cfg.cluster.surplus == SurplusRule.KEEP or now - self.looked < LOOK_EVERY:
            return self.decision
        self.looked = now
        assignments = self.cluster.assignments()
        if not assignments:
            return None
        epoch = latest(assignments)
        if epoch.epoch == self.decided:
            return self.decision
        earlier = self.cluster.children(RELEASES())
        previous = earlier[max(earlier)] if earlier else None
        nodes, shared = live(), frozenset(self.hosts())
        decision = decide_release(self.cfg, epoch, nodes, previous, bursts(self.cluster.failed()), time.time(), shared)
        self.decision, wrote = self.cluster.create_or_get(RELEASES(epoch.epoch), decision)
        self.decided = epoch.epoch
        # a group of machines of several workers is sized in machines, not nodes: it is not grown from here
        if wrote and not shared and self.decision.desired > (previous.desired if previous else len(nodes)):
            self.grown = self.decision.desired  # the group must grow: its writer says so, once
        return self.decision

    def round(self, live: Callable[[], dict[str, str]], looked: bool, leading: bool) -> Release | None:
        """An agent's round: the leader decides when it looks (`step`), another agent
        reads what the leader decided (`follow`)."""
        if looked:
            return self.step(live)
        return self.decision if leading else self.follow()

    def follow(self) -> Release | None:
        """For an agent that does not lead: the newest epoch's decision, once its
        leader wrote it (the newest epoch's number read at most every LOOK_EVERY)."""
        now = time.monotonic()
        if self.cfg.cluster.surplus == SurplusRule.KEEP or now - self.looked < LOOK_EVERY:
            return self.decision
        self.looked = now
        epoch = self.cluster.edge(ASSIGNMENT(), last=True)
        if epoch is not None and epoch != self.decided and (found := self.cluster.get(RELEASES(epoch))) is not None:
            self.decision, self.decided = found, epoch
        return self.decision

    def take_growth(self) -> int | None:
        """The nodes to grow the group to, once, if a decision of this agent asked for more."""
        grown, self.grown = self.grown, None
        return grown
