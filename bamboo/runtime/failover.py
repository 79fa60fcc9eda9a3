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

import time
from collections import Counter
from dataclasses import dataclass

from schedules.compiler import compile_recovery, compile_schedule
from schedules.ir import Instr, RECVS, SENDS
from schedules.layout import ScheduleError
from schedules.simulator import ValidationError

from bamboo.control.changes import Changes
from bamboo.control.cluster import Cluster
from bamboo.control.exits import Fenced
from bamboo.control.protocol import ABORT, CUT, FAILED, FINISHED, LEASE_EXPIRED, Abort, Cut, Failure, Mark


LEASE_WAIT = 0.5  # seconds a wait on peers lasts before their leases are asked, and between asks
WAIT_GAP = 0.2    # a pause this long between two asks of a waiting node ends its wait (recv asks every 50 ms)
LINGER_WAKE = 0.1  # a lingering node looks at least this often (a watch wakes it sooner)


class Unsurvivable(RuntimeError):
    """A failure this pipeline cannot recover from inside the iteration."""


class RecoveryBug(Exception):
    """Compiling a recovery failed for a reason no failure explains: a bug, reported
    with the schedule state that triggered it (not a RuntimeError: nothing treats
    it as a peer's failure)."""


class Aborted(RuntimeError):
    """The iteration is abandoned job-wide (a failure no pipeline could absorb):
    every node undoes its steps and waits for the agents' next configuration."""


# What a poll of the failover can find; the executor decides what each means for it.
@dataclass(frozen=True)
class PeerDead:
    """A node of this pipeline (local id) is recorded dead: switch to the recovery stream."""
    local: int


@dataclass(frozen=True)
class PeersSilent:
    """Peers (node ids) whose leases ran out: the executor records them dead (a
    record that exists already stands)."""
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class SelfDead:
    """This node is recorded dead (it was paused past its lease): it must stop."""


@dataclass(frozen=True)
class AbortPosted:
    """Some node abandoned the iteration job-wide."""
    why: str


@dataclass(frozen=True)
class TooManyDead:
    """More failures in this pipeline than one iteration can absorb."""
    why: str


def died_before(stream: list[Instr], received: dict[int, dict[str, int]]) -> int:
    """k such that the dead node's sends before k all arrived and none after did.
    `received[peer][kind]` counts what `peer` got from it this iteration."""
    seen: Counter = Counter()
    k = 0
    arrived_all_so_far = True
    for i, ins in enumerate(stream):
        if ins.op not in SENDS:
            continue
        n = seen[(ins.peer, ins.op)]
        seen[(ins.peer, ins.op)] += 1
        if received.get(ins.peer, {}).get(ins.op.value, 0) > n:
            if not arrived_all_so_far:
                raise Unsurvivable(f"node's messages arrived out of order (a later one, {ins}, "
                                   "arrived after an earlier one was lost)")
            k = i + 1
        else:
            arrived_all_so_far = False
    return k


class Failover:
    def __init__(self, cluster: Cluster, nodes: tuple[int, ...], pipeline: int, me: int, redundancy: str,
                 timeout: float, elastic: bool = False, failures: Changes | None = None,
                 finishes: Changes | None = None):
        self.cluster, self.nodes, self.pipeline, self.me = cluster, nodes, pipeline, me
        self.P = len(nodes)
        self.redundancy, self.timeout = redundancy, timeout
        self.elastic = elastic  # agents can redo the iteration: abort instead of failing the job
        self.failures = failures  # raised by a watch on failed/ and abort/ (None: read every 20 ms)
        self.finishes = finishes  # raised by a watch on finished/, failed/ and abort/ (wakes linger)
        self.seen_finished: dict | None = None  # the finished marks read with this node's own
        self.events: list[dict] = []
        self._recorded: set[int] = set()  # node ids recorded dead, as of the last look
        self._looked = False  # a look happened: _recorded stands until the watch says failed/ changed

    def unsurvivable(self, why: str):
        """Give up on this iteration: without agents the job fails; with them every
        node is told to abort (first writer's reason stands) and the iteration is redone."""
        if not self.elastic:
            raise Unsurvivable(why)
        self.cluster.create(ABORT(self.iteration), Abort(why, self.to_global(self.me)))
        raise Aborted(why)

    def check_abort(self) -> None:
        reason = self.cluster.get(ABORT(self.iteration)) if self.elastic else None
        if reason is not None:
            raise Aborted(reason.why)

    def to_global(self, local: int) -> int:
        return self.nodes[local]

    def begin(self, iteration: int, microbatches: int, failed: tuple[int, ...], comm) -> None:
        self.iteration, self.M, self.failed, self.comm = iteration, microbatches, failed, comm
        self.seen_finished = None
        self.base = compile_schedule(self.P, microbatches, failed, self.redundancy).streams
        self.baseline = comm.counts()  # messages received before this iteration
        self.dead: int | None = None
        self._checked = self._leases_checked = 0.0
        # etcd is read at the next poll whatever the watch says, unless the last look
        # stands: then the watch would have said so (abort/'s keys are per iteration)
        self._due = self.failures is None or self.elastic or not self._looked
        self._event = None if self._due else self._judge(self._recorded)
        self._wait_began = self._waited = 0.0  # the current wait on peers: when it began, last asked

    def detected(self, peer_global: int, how: str) -> None:
        self.cluster.create(FAILED(peer_global), Failure(self.iteration, self.to_global(self.me), how))
        self._due = True  # look again at once

    def poll(self):
        """What changed for this pipeline since the last look, as an event (None:
        nothing). Reads etcd only when its watch says failed/ or abort/ changed
        (without a watch, at most every 20 ms); never writes it."""
        self.cluster.progress()
        now = time.monotonic()
        changed = self.failures.take() if self.failures is not None else now - self._checked >= 0.02
        if changed or self._due:
            self._checked, self._due = now, False
            self._event = self._look()
        return self._event

    def _look(self):
        abort = self.cluster.get(ABORT(self.iteration)) if self.elastic else None
        if abort is not None:
            return AbortPosted(abort.why)
        self._recorded, self._looked = set(self.cluster.failed()), True
        return self._judge(self._recorded)

    def _judge(self, dead: set[int]):
        """The event that the nodes recorded `dead` make for this iteration."""
        new = sorted({s for s, n in enumerate(self.nodes) if n in dead} - set(self.failed))
        if self.me in new:
            return SelfDead()
        if len(new) > 1 or (self.dead is not None and new and new != [self.dead]):
            return TooManyDead(f"nodes {[self.to_global(n) for n in new]} of pipeline {self.pipeline} failed in "
                               f"iteration {self.iteration}: one failure per pipeline per iteration is survivable")
        self.dead = new[0] if new else None
        return PeerDead(self.dead) if new else None

    def settle(self, event) -> None:
        """What every reader of `poll` does alike: an abandoned iteration (Aborted)
        and this node's own death (Fenced) end what it runs; silent peers are
        recorded dead. Any other event is the reader's to act on."""
        if isinstance(event, AbortPosted):
            raise Aborted(event.why)
        if isinstance(event, SelfDead):
            node = self.to_global(self.me)
            raise Fenced(self.cluster.death_of(node) or f"node {node} was declared dead in iteration {self.iteration}")
        if isinstance(event, PeersSilent):
            for node in event.nodes:
                self.detected(node, LEASE_EXPIRED)

    def _silent_while_waiting(self, local_ids) -> PeersSilent | None:
        """Peers among `local_ids` whose leases ran out, asked only once a wait on
        peers has lasted LEASE_WAIT, then every LEASE_WAIT: a silent peer matters
        only to a node that waits for it, and the fault-free path asks nothing."""
        now = time.monotonic()
        if now - self._waited > WAIT_GAP:  # the last wait ended: this is a new one
            self._wait_began = now
        self._waited = now
        if now - self._wait_began < LEASE_WAIT or now - self._leases_checked < LEASE_WAIT:
            return None
        self._leases_checked = now
        silent = self._silent(local_ids)
        return PeersSilent(silent) if silent else None

    def _others(self) -> list[int]:
        return [n for n in range(self.P) if n not in self.failed and n != self.me]

    def peer_gone(self, node: int) -> bool:
        """Whether a send to `node` (a node id) waits in vain: the node is recorded
        dead, or its lease ran out (recorded here, then). Raises Aborted when the
        iteration was abandoned meanwhile."""
        event = self.poll()
        if isinstance(event, AbortPosted):
            raise Aborted(event.why)
        if event is None and (silent := self._silent_while_waiting(self._others())) and node in silent.nodes:
            self.detected(node, LEASE_EXPIRED)
            return True
        return node in self._recorded

    def _silent(self, local_ids) -> tuple[int, ...]:
        """The node ids, among `local_ids`, gone silent (bamboo/control/liveness.py)."""
        return tuple(self.cluster.silent(list(map(self.to_global, local_ids))))

    def finished(self) -> None:
        """This node's stream is done: its mark, written with a read of the
        pipeline's marks so far (one round trip), which the linger starts from."""
        mark = FINISHED(self.iteration, self.to_global(self.me))
        if self.finishes is not None:
            self.finishes.take(own=mark)  # lowered before the read: a finish after it wakes the linger
        self.seen_finished = self.cluster.put_and_read(mark, Mark(), FINISHED(self.iteration))[0]

    def linger(self, poll: float = 0.02, idle=None):
        """Wait until every node of the pipeline finished the iteration (None), or
        something needs this node again (the event): a failure, or a node that has
        neither finished nor kept its lease alive. Once every node finished, a
        death is one between iterations (a node may already be evaluating, and
        die there): nobody recovers it inside this iteration. `idle()` is called
        once, when the node has to wait (work that fits in the wait)."""
        while True:
            if self.seen_finished is not None:  # read with this node's own mark
                finished, self.seen_finished = self.seen_finished, None
            else:
                if self.finishes is not None:
                    self.finishes.take()  # lowered before reading: a finish after the read wakes the wait
                finished = self.cluster.children(FINISHED(self.iteration))
            pending = [n for n in range(self.P) if n not in self.failed and self.to_global(n) not in finished]
            if not pending:
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

    def keep_waiting(self) -> bool:
        """False once something needs this node (then `poll()` says what): asked by
        a receive that has waited a while for its peer."""
        if self.poll() is None:
            self._event = self._silent_while_waiting(self._others())
        return self._event is None

    def resolve(self) -> tuple[list[Instr], int]:
        """Block until the plan for the recorded failure is known; return this node's
        recovery stream and the index where its recovery part starts."""
        d, t0 = self.dead, time.monotonic()
        dg = self.to_global(d)
        receivers = sorted(n for n, s in self.base.items()
                           if n != d and any(i.op in RECVS and i.peer == d for i in s))
        if self.me in receivers:
            # A node that broke a channel may still have messages landing on others;
            # one found silent (its lease ran out) sent its last ones long ago.
            failure = self.cluster.get(FAILED(dg))
            deadline = time.monotonic() + (0 if failure and failure.how == LEASE_EXPIRED else self.timeout)
            while not self.comm.settled(dg) and time.monotonic() < deadline:
                time.sleep(0.01)
            counts = {kind.value: n - self.baseline.get((peer, kind), 0)
                      for (peer, kind), n in self.comm.counts().items() if peer == dg}
            self.cluster.put(CUT(self.iteration, dg, self.to_global(self.me)), Cut(counts))

        self.comm.abort_peer(dg)  # what has not landed by now never will: NCCL's waits on it end

        def reports():
            cut = self.cluster.children(CUT(self.iteration, dg))
            if len(cut) == len(receivers):
                return cut
            self.check_abort()
            missing = [self.to_global(n) for n in receivers if self.to_global(n) not in cut]
            gone = self.cluster.record_silent(missing, self.iteration, self.to_global(self.me))
            if gone:
                self.unsurvivable(f"nodes {gone} of pipeline {self.pipeline} died while it recovered from node {dg}")
            return None
        reports = self.cluster.wait_for(reports, timeout=max(30.0, 10 * self.timeout),
                                        what=f"survivors' reports on node {dg}")
        received = {self.nodes.index(n): cut.counts for n, cut in reports.items()}  # by local id
        k, rec = self._recovery(d, received)
        if self.me == (d - 1) % self.P:  # the node that takes the stage over tells
            self.events.append({"type": "failover", "node": dg, "iteration": self.iteration,
                                "died_before": k, "by": self.to_global(self.me),
                                "agree_seconds": round(time.monotonic() - t0, 4)})
        self.failed = tuple(sorted(self.failed + (d,)))  # the rest of the job runs merged
        self.dead = self._event = None
        self._due = True
        return rec.streams[self.me], rec.resume_at[self.me]

    def _recovery(self, d: int, received: dict[int, dict[str, int]]):
        """(k, the compiled recovery) for local node `d` dying with `received` counts.
        A failure the schedules cannot absorb is unsurvivable (by its reason); any
        other error is a bug of ours and is raised as one, with what triggered it."""
        k = None
        try:
            k = died_before(self.base[d], received)
            return k, compile_recovery(self.P, self.M, d, k, self.failed, self.redundancy)
        except Unsurvivable as e:
            self.unsurvivable(str(e))
        except ScheduleError as e:
            if isinstance(e, ValidationError):
                raise RecoveryBug(self._state(d, k, received, e)) from e
            self.unsurvivable(str(e))
        except Exception as e:  # noqa: BLE001 - reported with its state, never as a failure
            raise RecoveryBug(self._state(d, k, received, e)) from e

    def _state(self, d: int, k, received, error: Exception) -> str:
        return (f"internal error recovering from node {self.to_global(d)} (local {d}) dying before instruction {k} "
                f"of iteration {self.iteration}: P={self.P} M={self.M} failed={self.failed} "
                f"redundancy={self.redundancy} received={received}: {type(error).__name__}: {error}")
