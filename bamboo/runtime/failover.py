"""Failover inside an iteration: agree, through etcd, on who died and how far it got.

A node that sees a peer's channel close (or its lease expire) records the death
with a create-if-absent write. Every survivor of that pipeline then stops at its
next wait and resolves the same plan: the nodes that received messages from the
dead node publish how many of each kind they got; from those counts and the dead
node's stream every survivor computes the same k (the dead node ran exactly its
instructions before k), and the compiler's recovery streams for (dead, k) tell
each survivor how to finish the iteration from where it stands.
"""
from __future__ import annotations

import dataclasses
import time

from schedules.timing.checks import ValidationError
from schedules.compiler import compile_recovery, compile_schedule
from schedules.cost import CostModel
from schedules.ir import RECVS, Instr
from schedules.layout import ScheduleError
from schedules.options import Redundancy, ReplicaSync, ScheduleOptions

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.events import FailedOver
from bamboo.control.exits import Fenced
from bamboo.control.protocol import (ABORT, CUT, DONE, FAILED, FINISHED, LEASE_EXPIRED, Abort, Cut, Failure, Finished,
                                     Local, NodeId)
from bamboo.runtime.cuts import Unsurvivable, died_before
from bamboo.runtime.lending import Loans
from bamboo.runtime.marks import Gather
from bamboo.runtime.watch import (AbortPosted, Completed, PeerDead, PeersSilent, SelfDead, TooManyDead, Watch,
                                   Watches)
from bamboo.transport.comm import Comm

LEASE_WAIT = 0.5  # seconds a wait on peers lasts before their leases are asked, and between asks
WAIT_GAP = 0.2    # a pause this long between two asks of a waiting node ends its wait (recv asks every 50 ms)
LINGER_WAKE = 0.1  # a lingering node looks at least this often (a watch wakes it sooner)


class RecoveryBug(Exception):
    """Compiling a recovery failed for a reason no failure explains: a bug, reported
    with the schedule state that triggered it (not a RuntimeError: nothing treats
    it as a peer's failure)."""


class Aborted(RuntimeError):
    """The iteration is abandoned job-wide (a failure no pipeline could absorb):
    every node undoes its steps and waits for the agents' next configuration."""


class Failover:
    def __init__(self, cluster: Cluster, nodes: tuple[int, ...], pipeline: int, me: int,
                 options: ScheduleOptions, cfg: JobConfig, watches: Watches | None = None, report_of=None):
        """`options`: how this epoch's streams are compiled (its mode may be auto's
        choice); `cfg`: the job's --failure-timeout, and whether agents run it."""
        self.cluster, self.nodes, self.pipeline, self.me = cluster, nodes, pipeline, me
        self.P = len(nodes)
        self.options = options
        self.timeout = cfg.faults.failure_timeout
        # each replica's sync at the iteration's end, or in the next (schedules/syncs.py); off keeps none
        self.sync = options.sync if options.redundancy is not Redundancy.OFF else ReplicaSync.END
        self.compiled_sync = options.sync  # the iteration's: "none" for a first one of --replica-sync next
        self.cost: CostModel | None = None  # measured, agreed at a boundary (runtime/calibration.py); None: default
        self.elastic = cfg.cluster.elastic  # agents can redo the iteration: abort instead of failing the job
        self.failures = watches.failures if watches else None
        self.finishes = watches.finishes if watches else None
        self.report_of = report_of  # () -> this node's Report as it stands, for its finished mark (None: none)
        self.loans: Loans | None = None  # what this node lends and borrows for a death in a late sync's window
        self.events: list[FailedOver] = []  # this node's, until its next report
        self.now: Watch | None = None       # the iteration under way (begin)
        self._recorded: set[NodeId] = set()  # recorded dead, as of the last look
        self._looked = False  # a look happened: _recorded and _aborts stand until the watch says otherwise
        self._aborts: dict = {}  # {iteration: Abort} of the last look's iteration and the next

    # The options, as the runtime's readers ask for them.
    redundancy = property(lambda self: self.options.redundancy)
    frc = property(lambda self: self.options.frc)      # eager: FRC only in the bubbles, or for all
    split = property(lambda self: self.options.split)  # last backwards split (schedules/early_grads.py)

    @property
    def iteration(self) -> int:
        return self.now.iteration

    @property
    def failed(self) -> tuple[Local, ...]:
        return self.now.failed

    def unsurvivable(self, why: str):
        """Give up on this iteration: without agents the job fails; with them every
        node is told to abort (first writer's reason stands) and the iteration is redone."""
        if not self.elastic:
            raise Unsurvivable(why)
        self.cluster.create(ABORT(self.iteration), Abort(why, self.node_of(self.me)))
        raise Aborted(why)

    def check_abort(self) -> None:
        reason = self.cluster.get(ABORT(self.iteration)) if self.elastic else None
        if reason is not None:
            raise Aborted(reason.why)

    def node_of(self, local: Local) -> NodeId:
        return NodeId(self.nodes[local])

    def local_of(self, node: NodeId) -> Local:
        return Local(self.nodes.index(node))

    def begin(self, iteration: int, microbatches: int, failed: tuple[Local, ...], comm: Comm,
              kills: tuple[tuple[int, int], ...] = (), owed: bool = False, final: bool = False) -> None:
        """Compile the iteration's streams, FRC placed with the measured cost model
        once one is agreed. `kills`: this iteration's --preempt (node, position)
        pairs, counted in the default model's streams; where the measured placement
        would move one, the default model places FRC in this iteration. `owed`: the
        iteration before ran here (--replica-sync next: its syncs are due). `final`:
        the reports in the marks are the iteration's (its collector writes them)."""
        self._check_owed(iteration, failed, owed)
        self.compiled_sync = self.sync if self.sync is ReplicaSync.END or owed else ReplicaSync.NONE
        cost = self._placement(microbatches, failed, kills)
        streams = self.streams_for(microbatches, failed, cost)
        # etcd is read at the next poll whatever the watch says, unless the last look
        # stands: then the watch would have said so. abort/'s keys are per iteration:
        # a look reads the next one's too, as a peer may be an iteration ahead (this
        # node evaluates, or waits for the agreement) but never two.
        due = self.failures is None or not self._looked
        self.now = Watch(iteration, microbatches, failed, comm, streams, cost, baseline=comm.counts(), due=due,
                         dead_before=frozenset(self._recorded))
        if getattr(comm, "carries_notes", False):
            live = tuple(self.node_of(Local(n)) for n in range(self.P) if n not in failed)
            self.now.gather = Gather(iteration, live, self.node_of(self.me), comm, final)
        if self.loans is not None:
            self.loans.begin(iteration, comm)
        if not due:
            abort = self._aborts.get(iteration)
            self.now.event = AbortPosted(abort.why) if abort is not None else self._judge(self._recorded)

    def _check_owed(self, iteration: int, failed: tuple[Local, ...], owed: bool) -> None:
        """--replica-sync next: a node dead since the last iteration took its sync of
        it along: its holder's replica is a step behind (agents count the stage lost)."""
        behind = self.sync is ReplicaSync.NEXT and owed and self.now
        for dead in sorted(set(failed) - set(self.now.failed)) if behind else ():
            raise Unsurvivable(f"node {self.node_of(dead)} died between iterations before its sync of iteration "
                               f"{iteration - 1} reached node {self.node_of(Local((dead - 1) % self.P))}, whose "
                               "replica of its stage is then a step behind (--replica-sync next)")

    def _placement(self, microbatches: int, failed: tuple[Local, ...], kills) -> CostModel:
        """The cost model FRC is placed with: the measured one, unless it moves the
        instructions before a kill position of this pipeline's."""
        here = [(self.nodes.index(n), k) for n, k in kills if n in self.nodes]
        if self.cost is None or not here:
            return self.cost or CostModel()
        measured, default = (self.streams_for(microbatches, failed, c) for c in (self.cost, CostModel()))
        moved = any(measured.get(me, [])[:k + 1] != default.get(me, [])[:k + 1] for me, k in here)
        return CostModel() if moved else self.cost

    def streams_for(self, microbatches: int, failed: tuple[Local, ...], cost: CostModel) -> dict[int, list[Instr]]:
        """Every node's fault-free stream of an iteration of this epoch with `failed` merged."""
        return compile_schedule(self.P, microbatches, failed, self._compiled(), cost).streams

    def _compiled(self) -> ScheduleOptions:
        """The options this iteration's streams are compiled with (its sync may be none)."""
        return self.options.with_(sync=self.compiled_sync)

    def detected(self, node: NodeId, how: str) -> None:
        self.cluster.record_dead(node, Failure(self.iteration, self.node_of(self.me), how))
        self.now.due = True  # look again at once

    def poll(self):
        """What changed for this pipeline since the last look, as an event (None:
        nothing). Reads etcd only when its watch says failed/ or abort/ changed
        (without a watch, at most every 20 ms); never writes it."""
        self.cluster.progress()
        now = time.monotonic()
        changed = self.failures.take() if self.failures is not None else now - self.now.checked >= 0.02
        if changed or self.now.due:
            self.now.checked, self.now.due = now, False
            self.now.event = self._look()
        return self.now.event

    def _look(self):
        it = self.iteration
        aborts, recorded = self.cluster.read_with_aborts(range(it, it + 2), FAILED()) if self.elastic else \
            ({}, self.cluster.failed())
        if it in aborts:
            return AbortPosted(aborts[it].why)
        self._recorded, self._aborts, self._looked = set(recorded), aborts, True
        self.serve_loans(self._recorded)
        return self._judge(self._recorded)

    def serve_loans(self, recorded) -> None:
        """Lend what peers of other pipelines asked for, once a node died in this
        iteration (bamboo/runtime/lending.py): read in every look, and by the boundary."""
        if self.lending(recorded):
            self.loans.serve()

    def lending(self, recorded) -> bool:
        """Whether peers may ask this node for gradients: a node died in this iteration."""
        return self.loans is not None and self.loans.lends and bool(set(recorded) - self.now.dead_before)

    def _judge(self, recorded: set[NodeId]):
        """The event that the nodes `recorded` dead make for this iteration."""
        new = sorted({Local(s) for s, n in enumerate(self.nodes) if n in recorded} - set(self.failed))
        if self.me in new:
            return SelfDead()
        if len(new) > 1 or (self.now.dead is not None and new and new != [self.now.dead]):
            return TooManyDead(f"nodes {[self.node_of(n) for n in new]} of pipeline {self.pipeline} failed in "
                               f"iteration {self.iteration}: one failure per pipeline per iteration is survivable")
        if new and self.now.recovered:  # the recovery streams are no base for a second plan
            return TooManyDead(f"node {self.node_of(new[0])} of pipeline {self.pipeline} failed in iteration "
                               f"{self.iteration} after the pipeline recovered from another death in it: one "
                               "failure per pipeline per iteration is survivable")
        self.now.dead = new[0] if new else None
        return PeerDead(self.now.dead) if new else None

    def settle(self, event) -> None:
        """What every reader of `poll` does alike: an abandoned iteration (Aborted)
        and this node's own death (Fenced) end what it runs; silent peers are
        recorded dead. Any other event is the reader's to act on."""
        if isinstance(event, AbortPosted):
            raise Aborted(event.why)
        if isinstance(event, SelfDead):
            node = self.node_of(self.me)
            raise Fenced(self.cluster.death_of(node) or f"node {node} was declared dead in iteration {self.iteration}")
        if isinstance(event, PeersSilent):
            for node in event.nodes:
                self.detected(node, LEASE_EXPIRED)

    def _silent_while_waiting(self, locals_: list[Local]) -> PeersSilent | None:
        """Peers among `locals_` whose leases ran out, asked only once a wait on
        peers has lasted LEASE_WAIT, then every LEASE_WAIT: a silent peer matters
        only to a node that waits for it, and the fault-free path asks nothing."""
        now, it = time.monotonic(), self.now
        if now - it.waited > WAIT_GAP:  # the last wait ended: this is a new one
            it.wait_began = now
        it.waited = now
        if now - it.wait_began < LEASE_WAIT or now - it.leases_checked < LEASE_WAIT:
            return None
        it.leases_checked = now
        silent = self._silent(locals_)
        return PeersSilent(silent) if silent else None

    def _others(self) -> list[Local]:
        return [Local(n) for n in range(self.P) if n not in self.failed and n != self.me]

    def peer_gone(self, node: NodeId) -> bool:
        """Whether a send to `node` waits in vain: the node is recorded
        dead, or its lease ran out (recorded here, then). Raises Aborted when the
        iteration was abandoned meanwhile."""
        event = self.poll()
        if isinstance(event, AbortPosted):
            raise Aborted(event.why)
        if event is None and (silent := self._silent_while_waiting(self._others())) and node in silent.nodes:
            self.detected(node, LEASE_EXPIRED)
            return True
        return node in self._recorded

    def _marks(self) -> dict:
        """The finished marks of this pipeline's nodes in the iteration, {node: mark},
        in one transaction: not every node's of the job."""
        it = self.iteration
        found = self.cluster.read_spans(*((FINISHED(it, n), FINISHED(it, n + 1)) for n in self.nodes))
        return {node: mark for span in found for (_, node), mark in span.items()}

    def _silent(self, locals_: list[Local]) -> tuple[NodeId, ...]:
        """The nodes, among `locals_`, gone silent (bamboo/control/liveness.py)."""
        return tuple(self.cluster.silent(list(map(self.node_of, locals_))))

    def finished(self, also: dict | None = None) -> None:
        """This node's stream is done: its mark, carrying its report as it stands
        (`report_of`), with `also` (the losses it holds). While the pipeline gathers
        its marks (bamboo/runtime/marks.py) it goes to the collector. Else it is
        written with a read of the pipeline's marks so far (one round trip), which
        the linger starts from, and of the reports and deaths, which the boundary
        starts from if this mark completes the pipeline; a collector that stops
        gathering writes what it gathered with it."""
        mark = FINISHED(self.iteration, self.node_of(self.me))
        if self.loans is not None:
            self.loans.done = True  # a sum it has not reduced by now it will not (unless it takes a stage over)
        gather = self.now.gather
        if self._gathering():
            gather.finish(self.report_of().to_dict() if self.report_of else None, also or {})
            return
        if gather is not None and gather.collecting and gather.on:
            gather.on = False
            also = {**gather.records(reports=False), **(also or {})}
        elif gather is not None and gather.sent and not gather.written:  # its note may never be written
            also = {**gather.carried, **(also or {})}
        if self.finishes is not None:
            self.finishes.take(own=mark)  # lowered before the read: a finish after it wakes the linger
        record = Finished(self.report_of().to_dict() if self.report_of else None)
        self.now.seen_finished, *read = self.cluster.put_and_read(
            mark, record, FINISHED(self.iteration), DONE(self.iteration), FAILED(), also=also)
        self.now.read_with_mark = tuple(read)

    def _gathering(self) -> bool:
        """Whether this node's mark goes to its pipeline's collector: the pipeline
        gathers them, this node has not marked yet, and nobody of it died."""
        gather = self.now.gather
        first = gather is not None and gather.on and not gather.sent and gather.me not in gather.notes
        return first and self.now.dead is None and not self.now.recovered

    @property
    def reported(self) -> bool:
        """Whether this node's report of the iteration was written with its pipeline's marks."""
        gather = self.now.gather
        return gather is not None and gather.written and gather.reported

    def linger(self, poll: float = 0.02, idle=None):
        """Wait until every node of the pipeline finished the iteration (None), or
        something needs this node again (the event): a failure, or a node that has
        neither finished nor kept its lease alive. Once every node finished, a
        death is one between iterations (a node may already be evaluating, and
        die there): nobody recovers it inside this iteration. `idle()` is called
        once, when the node has to wait (work that fits in the wait)."""
        gather = self.now.gather
        if gather is not None and gather.on and (gather.sent or gather.me in gather.notes):
            idle = self._linger_gathered(idle)
            if gather.written:
                return None
        while True:
            own = self.now.seen_finished is not None  # read with this node's own mark
            if own:
                finished, self.now.seen_finished = self.now.seen_finished, None
            else:
                if self.finishes is not None:
                    self.finishes.take()  # lowered before reading: a finish after the read wakes the wait
                finished = self._marks()
            pending = [Local(n) for n in range(self.P) if n not in self.failed and self.node_of(n) not in finished]
            if not pending:
                done = own and not self.now.recovered
                ours = {n: mark for n, mark in finished.items() if n in self.nodes}  # others' may yet recover
                self.now.completed = Completed(ours, *self.now.read_with_mark) if done else None
                return None
            event = self.poll() or self._silent_while_waiting(pending)
            if event is not None:
                return event
            if idle is not None:
                idle, work = None, idle
                work()
                continue  # what came in meanwhile is read before any wait
            if self.finishes is not None:
                self.finishes.wait(LINGER_WAKE)
            else:
                time.sleep(poll)

    def _linger_gathered(self, idle):
        """The linger while the pipeline gathers its marks: the collector waits for
        every mark and writes them, the others for its word that it did; anything
        else (an event) ends the gathering, and the linger goes on as without it.
        Returns `idle` if it was not called."""
        gather = self.now.gather
        while True:
            if gather.collecting:
                gather.take()
                if gather.complete():
                    self.cluster.put_all(gather.records())
                    gather.tell()
                    return idle
            elif gather.answered():
                return idle
            if (event := self.poll() or self._silent_while_waiting(self._others())) is not None:
                self.now.event = event
                if gather.collecting:
                    self.finished()  # its own mark, with what it gathered
                gather.on = False
                return idle
            if idle is not None:
                idle, work = None, idle
                work()
                continue
            gather.wait()

    def keep_waiting(self) -> bool:
        """False once something needs this node (then `poll()` says what): asked by
        a receive that has waited a while for its peer."""
        if self.poll() is None:
            self.now.event = self._silent_while_waiting(self._others())
        return self.now.event is None

    def resolve(self) -> tuple[list[Instr], int]:
        """Block until the plan for the recorded failure is known; return this node's
        recovery stream and the index where its recovery part starts."""
        dead, began = self.now.dead, time.monotonic()
        node = self.node_of(dead)
        if self.loans is not None:
            self.loans.done = False  # the recovery may reduce a stage taken over
        receivers = sorted(Local(n) for n, s in self.now.streams.items()
                           if n != dead and any(i.op in RECVS and i.peer == dead for i in s))
        if self.me in receivers:
            self._report_cut(node)
        self.now.comm.abort_peer(node)  # what has not landed by now never will: NCCL's waits on it end
        received = self._cuts(node, receivers)
        k, rec = self._recovery(dead, received)
        if self.me == (dead - 1) % self.P:  # the node that takes the stage over tells
            self.events.append(FailedOver(node, self.iteration, k, self.node_of(self.me),
                                          round(time.monotonic() - began, 4)))
            self.record_loan()
        self.now.failed = tuple(sorted(self.failed + (dead,)))  # the rest of the job runs merged
        self.now.recovered = True
        self.now.dead = self.now.event = None
        self.now.due = True
        return rec.streams[self.me], rec.resume_at[self.me]

    def _report_cut(self, node: NodeId) -> None:
        """How many messages of each kind this node got from the dead `node`. One
        that broke a channel may still have messages landing on others; one found
        silent (its lease ran out) sent its last ones long ago."""
        failure = self.cluster.get(FAILED(node))
        deadline = time.monotonic() + (0 if failure and failure.how == LEASE_EXPIRED else self.timeout)
        while not self.now.comm.settled(node) and time.monotonic() < deadline:
            time.sleep(0.01)
        counts = {kind.value: n - self.now.baseline.get((peer, kind), 0)
                  for (peer, kind), n in self.now.comm.counts().items() if peer == node}
        if self.compiled_sync is ReplicaSync.NEXT and self.loans is not None:  # a sync not landed: borrowed
            counts = self.loans.late_sync(self.now.streams[self.local_of(node)], self.me, counts, self.pipeline,
                                          self.lender_alive)
        self.cluster.put(CUT(self.iteration, node, self.node_of(self.me)), Cut(counts))

    def lender_alive(self, node: NodeId) -> bool:
        """Whether a lender is still worth waiting for (Aborted: the iteration was abandoned)."""
        self.check_abort()
        return node not in self.cluster.failed() and not self.cluster.record_silent([node], self.iteration,
                                                                                    self.node_of(self.me))

    def record_loan(self) -> None:
        """The loan this node took for the death it took over, on that death's event."""
        if self.loans is not None and self.loans.last and self.events:
            by, what, seconds = self.loans.last
            self.events[-1] = dataclasses.replace(self.events[-1], lent_by=by, lent=what, lend_seconds=seconds)

    def _cuts(self, node: NodeId, receivers: list[Local]) -> dict[Local, dict[str, int]]:
        """Every receiver's report on the dead `node`, by receiver."""
        def reports():
            cut = self.cluster.children(CUT(self.iteration, node))
            if len(cut) == len(receivers):
                return cut
            self.check_abort()
            missing = [self.node_of(n) for n in receivers if self.node_of(n) not in cut]
            gone = self.cluster.record_silent(missing, self.iteration, self.node_of(self.me))
            if gone:
                self.unsurvivable(f"nodes {gone} of pipeline {self.pipeline} died while it recovered from node {node}")
            return None
        found = self.cluster.wait_for(reports, timeout=max(30.0, 10 * self.timeout),
                                      what=f"survivors' reports on node {node}")
        return {self.local_of(n): cut.counts for n, cut in found.items()}

    def _recovery(self, dead: Local, received: dict[Local, dict[str, int]]):
        """(k, the compiled recovery) for `dead` dying with `received` counts.
        A failure the schedules cannot absorb is unsurvivable (by its reason); any
        other error is a bug of ours and is raised as one, with what triggered it."""
        k = None
        try:
            k = died_before(self.now.streams[dead], received, late=self.compiled_sync is ReplicaSync.NEXT)
            return k, compile_recovery(self.P, self.now.microbatches, dead, k, self.failed, self._compiled(),
                                       self.now.cost)
        except Unsurvivable as e:
            self.unsurvivable(str(e))
        except ScheduleError as e:
            if isinstance(e, ValidationError):
                raise RecoveryBug(self._state(dead, k, received, e)) from e
            self.unsurvivable(str(e))
        except Exception as e:  # noqa: BLE001 - reported with its state, never as a failure
            raise RecoveryBug(self._state(dead, k, received, e)) from e

    def _state(self, dead: Local, k, received, error: Exception) -> str:
        return (f"internal error recovering from node {self.node_of(dead)} (local {dead}) dying before instruction "
                f"{k} of iteration {self.iteration}: P={self.P} M={self.now.microbatches} failed={self.failed} "
                f"redundancy={self.redundancy} frc={self.frc} received={received}: {type(error).__name__}: {error}")
