"""Node emulators: the control plane of one node (its worker's and its agent's) on
threads, with no model and no stream's messages, so that one machine holds hundreds.

Each node runs the real parts that talk to etcd, with the real keys and records:
the worker registers its leased `alive` key (Cluster.register), runs each iteration
through a real Failover (`begin`, the finished mark with the losses the last stage
holds, gathered by the pipeline's collector over the emulated data plane's notes,
the linger) and a real Boundary (report, agree), writes its stage's reduce record
when the job has several pipelines and it is one of the record's writers, and moves
to the agents' next epoch; the agent holds a Membership (leased `members`, `zones`)
and a Releaser, and looks at etcd as bamboo-agent does: at its monitor interval it
asks `due` (true only for the leading agent), and then decides, observes the modes
and steps the releaser; another agent follows the releaser's decision, waking at
the pace of the requests it makes (FOLLOWER_SECONDS) rather than every round. What a
stream computes is a sleep: stage s ends its stream at (0.9 + 0.1 s / P) of the
iteration time, the last stage last, as 1F1B's drain has it.

A death is a node that stops: its leases are left to age (Heartbeat.halt, as a
machine gone refreshes nothing), it sends no more notes, and every later etcd call
of its threads raises Killed. Nodes beyond the pipelines wait in standby (--surplus
keep: a released node would drain, which the emulator does not). No receive waits
on the dead (a real worker's first sign), so the survivors find a death in their
linger, by the dead node's lease, and recover as the executor does: cut reports,
the plan, a new mark. The handover of a new epoch moves no layers: each node writes
its mark and the first the outcome, as bamboo/state/handover.py does.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

from agents.membership import LOOK_EVERY as MEMBERS_LOOK_EVERY
from agents.membership import Membership
from agents.release import LOOK_EVERY as RELEASE_LOOK_EVERY
from agents.release import Releaser
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import (ABORT, ABORTED, ASSIGNMENT, DRAIN, FAILED, HANDED, HANDOVER, LOAN, LOSS,
                                     REDUCED, REGROUP, Loss, Mark, Outcome, Reduced, Report)
from bamboo.runtime.boundary import Boundary
from bamboo.runtime.failover import Aborted, Failover
from bamboo.runtime.reduce import RECORDERS
from bamboo.runtime.watch import PeersSilent, TooManyDead, Watches
from bamboo.state.checkpoint import Checkpoints
from bamboo.state.epochs import EPOCH_POLL
from schedules.layout import Layout

MONITOR_SECONDS = 0.05  # bamboo-agent's monitor interval: how often an agent decides
# An agent that does not lead asks etcd nothing more often than this (its releaser's
# follow, the next in line's look at the leader) unless a member joins or leaves,
# which wakes it: its real 50 ms rounds would cost only the emulator's CPU.
FOLLOWER_SECONDS = min(RELEASE_LOOK_EVERY, MEMBERS_LOOK_EVERY)


class Killed(BaseException):
    """The node is dead: its threads unwind (a BaseException, so that no handler of
    the real code that catches errors keeps a dead node running)."""


class NodeCluster(Cluster):
    """One node process's etcd client: each request timed into `latencies`, and
    refused once the node is killed."""

    def __init__(self, endpoint: str, job: str, latencies: list, killed: threading.Event, client=None):
        self.shared = client  # an etcd client several emulated nodes share (None: one of its own)
        super().__init__(endpoint, job, patience=60.0)
        self.latencies, self.killed = latencies, killed

    def _connect(self, endpoint: str, patience: float, tls):
        return self.shared if self.shared is not None else Cluster._connect(endpoint, patience, tls)

    def call(self, fn):
        if self.killed.is_set():
            raise Killed()
        began = time.perf_counter()
        try:
            return super().call(fn)
        finally:
            self.latencies.append(time.perf_counter() - began)


class Notes:
    """The notes every node's data plane carries (its finished marks on their way to
    the pipeline's collector, bamboo/runtime/marks.py), by (sender, receiver)."""

    def __init__(self):
        self.queues: dict[tuple[int, int], deque] = defaultdict(deque)

    def deliver(self, sender: int, receiver: int, data: bytes) -> None:
        self.queues[(sender, receiver)].append(data)


class Plane:
    """The data plane a Failover is given: notes, but no stream's messages, so a cut
    report says nothing was received from the dead (its recovery plan is the early
    death's). A dead node sends nothing more; what it sent before stays delivered."""

    carries_notes = True

    def __init__(self, notes: Notes, me: int, killed: threading.Event):
        self.notes, self.me, self.killed = notes, me, killed

    def note(self, peer: int, data: bytes) -> None:
        if self.killed.is_set():
            raise Killed()
        self.notes.deliver(self.me, peer, data)

    def take_note(self, peer: int) -> bytes | None:
        queue = self.notes.queues[(peer, self.me)]
        return queue.popleft() if queue else None

    def counts(self) -> dict:
        return {}

    def settled(self, node: int) -> bool:
        return True

    def abort_peer(self, node: int) -> None:
        pass


class EmulatedNode:
    """One node: a worker thread and an agent thread, each with an etcd client."""

    def __init__(self, endpoint: str, cfg: JobConfig, node: int, zone: str, seconds: float, latencies: list,
                 notes: Notes, client=None):
        """`client`: an etcd client shared with other emulated nodes (None: one per
        worker and agent, as real processes have)."""
        self.cfg, self.node, self.seconds = cfg, node, seconds
        self.killed = threading.Event()
        self.plane = Plane(notes, node, self.killed)
        self.worker = NodeCluster(endpoint, cfg.cluster.job, latencies, self.killed, client)
        self.agent = NodeCluster(endpoint, cfg.cluster.job, latencies, self.killed, client)
        self.membership = Membership(self.agent, zone, node, cfg)
        self.releaser = Releaser(self.agent, cfg, self.membership.hosts)
        self.worker.register(node, cfg, on_fenced=lambda why: self.killed.set())
        # the watches a worker keeps for its life (Worker.__init__)
        self.watches = Watches(self.worker.changes(FAILED(), ABORT(), LOAN()),
                               self.worker.changes(FAILED(), ABORT()))
        self.boundary_changes = self.worker.changes(FAILED(), ABORT(), REGROUP())
        self.epochs = self.worker.changes(ASSIGNMENT(), DRAIN())
        self.error: BaseException | None = None
        self.started = threading.Event()  # its first iteration began (or it waits in standby)
        self.iteration = -1  # the last iteration this node agreed
        self._epoch: int | None = None  # the epoch whose failover and boundary are made
        self._epoch_parts: tuple | None = None
        self.threads = [threading.Thread(target=self._guard, args=(f, ), daemon=True, name=f"{f.__name__}-{node}")
                        for f in (self._work, self._decide)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def kill(self) -> None:
        """Stop as a machine taken away: no more requests, the leases left to age."""
        self.killed.set()
        for cluster in (self.worker, self.agent):
            cluster.heartbeat.halt()

    def _guard(self, run) -> None:
        try:
            run()
        except Killed:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by the harness, with the node
            if not self.killed.is_set():
                self.error = e

    def _decide(self) -> None:
        """bamboo-agent's round (agents/agent.py `_step`), for as long as the worker runs."""
        while not self.killed.is_set() and self.threads[0].is_alive():
            self.membership.wait(MONITOR_SECONDS if self.membership.leading else FOLLOWER_SECONDS)
            looked = self.membership.due()
            if looked:
                self.membership.decide(self.cfg)
                self.membership.observe_modes(self.cfg)
            self.releaser.round(self.membership.live, looked, self.membership.leading)

    def _work(self) -> None:
        if self._assigned(-1) is None:
            self.started.set()  # in standby
        assignment = self.worker.wait_for(lambda: self._assigned(-1), timeout=3600, what="a stage", poll=EPOCH_POLL,
                                          changes=self.epochs)
        it, failed = assignment.start, assignment.gone
        while it < self.cfg.schedule.iterations:
            try:
                agreed = self._iteration(it, assignment, failed)
            except Aborted:  # the agents redo it (Worker.reconfigure)
                self.worker.put(ABORTED(it, self.node), Mark())
                assignment = self._next_epoch(assignment.epoch)
                it, failed = assignment.start, assignment.gone
                continue
            self.iteration, failed = it, agreed.failed
            if agreed.reconfigure and it + 1 < self.cfg.schedule.iterations:
                assignment = self._next_epoch(assignment.epoch)
                it, failed = assignment.start, assignment.gone
                continue
            it += 1

    def _assigned(self, after: int) -> Assignment | None:
        """The newest epoch after `after`, once one names this node."""
        newest = self.worker.latest_assignment()
        return newest if newest.epoch > after and self.node in newest.members else None

    def _next_epoch(self, after: int) -> Assignment:
        new = self.worker.wait_for(lambda: self._assigned(after), timeout=3600,  # a standby waits
                                   what="the agents' next configuration", poll=EPOCH_POLL, changes=self.epochs)
        self.worker.put(HANDED(new.epoch, self.node), Mark())
        self.worker.create(HANDOVER(new.epoch), Outcome(True, ""))
        return new

    def _parts(self, assignment: Assignment) -> tuple[Failover, Boundary, list]:
        """The epoch's failover, boundary and this pipeline's microbatches, made once
        per epoch as a worker's `enter` does."""
        if self._epoch != assignment.epoch:
            pipeline, me = assignment.slot(self.node)
            mbs = assignment.microbatches(self.cfg.schedule.microbatches, pipeline)
            options = self.cfg.options(assignment.redundancy, self.cfg.schedule.epoch_sync(assignment))
            failover = Failover(self.worker, assignment.pipelines[pipeline], pipeline, me, options, self.cfg,
                                self.watches, report_of=lambda: self._report(assignment.epoch))
            boundary = Boundary(self.worker, self.node, True, Checkpoints(self.cfg, self.node, 1),
                                auto=self.cfg.agents_choose, changes=self.boundary_changes)
            self._epoch, self._epoch_parts = assignment.epoch, (failover, boundary, mbs)
        return self._epoch_parts

    def _report(self, epoch: int) -> Report:
        return Report(rss_mb=0.0, time=time.time(), epoch=epoch, busy=0.9 * self.seconds)

    def _iteration(self, it: int, assignment: Assignment, failed: tuple[int, ...]):
        """One iteration's control plane: the stream's time, the reduce records, the
        finished mark (with the losses), the linger, the report and the agreement."""
        began = time.monotonic()
        failover, boundary, mbs = self._parts(assignment)
        boundary.arm()
        self.started.set()
        pipeline, me = assignment.slot(self.node)
        failover.begin(it, len(mbs), assignment.local_failed(pipeline, failed), self.plane,
                       final=True)
        P, D = failover.P, len(assignment.pipelines)
        time.sleep(max(0.0, began + self.seconds * (0.9 + 0.1 * (me + 1) / P) - time.monotonic()))
        owned = Layout(P, frozenset(failover.failed), failover.options.keeps_replicas).owned(me)
        losses = {LOSS(it, g): Loss(1.0) for g in mbs} if P - 1 in owned else {}
        if D > 1:
            if losses:
                self.worker.put_all(losses)  # before the reduce, as the executor does with several pipelines
                losses = {}
            for stage in owned:  # as the real reducer: a taker reads the record; two members write it
                members = tuple(sorted(p[stage] for p in assignment.pipelines if stage < len(p)))
                if failover.now.recovered:
                    self.worker.get(REDUCED(it, stage))
                if self.node in members[:RECORDERS]:
                    self.worker.put(REDUCED(it, stage), Reduced(members))
        self._stream_end(failover, losses)
        boundary.report(it, self._report(assignment.epoch), failover.now.completed, reported=failover.reported)
        return boundary.agree(it, assignment, failover, failed, regroup=lambda *_: None)

    @staticmethod
    def _stream_end(failover: Failover, losses: dict) -> None:
        """The finished mark and the linger; a death found there is handled as the
        executor does (_on_event): silent peers recorded dead, then the recovery's
        cut reports and plan (resolve), and a new mark."""
        failover.finished(also=losses or None)
        while (event := failover.linger()) is not None:
            failover.settle(event)  # Aborted, Fenced; silent peers recorded dead
            if not isinstance(event, PeersSilent):
                if isinstance(event, TooManyDead):
                    failover.unsurvivable(event.why)
                failover.resolve()
            failover.finished()
