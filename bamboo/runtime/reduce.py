"""Data parallelism: sum each stage's gradients over the D pipelines.

The group of a stage is its current owner in every pipeline (after a failure, the
predecessor that took the stage over). A reduce that fails because a member died
waits until that death is recorded and retries in the group of the new owners,
from an untouched copy of the local gradients. A member that finished a reduce
and then died took part of the sum with it: that case is refused, by name.

A tied weight (GPT-2's token embedding and output head) has a copy on the first
and on the last stage; `tie` sums the copies' gradients within a pipeline after
the data-parallel reduce, so every copy takes the same step, as DeepSpeed's tied
layers do. A tie whose partner dies is given up (Interrupted): the executor
replans and ties again where its new stream says. A tie or a stage's reduce
waiting while a death elsewhere in this node's pipeline needs it (its report, its
re-sends) is left too, its allreduce pending, and taken up again after the replan:
a member of this reduce may be waiting, in another group, for the very node that
waits for that report (chaos seed 20 waited 30 s on such a cycle).
"""
from __future__ import annotations

import time
from collections import Counter

from schedules.layout import Layout, ScheduleError

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import REDUCED, TIED, Reduced, reduce_store, tie_store
from bamboo.model import recipe
from bamboo.runtime.failover import Aborted
from bamboo.runtime.lending import REDUCED_SUM, NoLender
from bamboo.transport.comm import Interrupted
from bamboo.transport.groups import GroupMaker, Opening, lease_check, start_group


# Members of a reduce group that record the sum done: two, so that one death after the
# sum leaves the record (a taker of that death's stage reads it); not all D of them.
RECORDERS = 2
REDUCE = "reduce"  # Reducer.sent's key: a stage's gradients, once per reduce (what a ring all-reduce sums)


class Reducer:
    def __init__(self, cluster: Cluster, assignment: Assignment, me: int, timeout: float, failover,
                 hang_timeout: float, make_group: GroupMaker | None = None, sent: Counter | None = None):
        self.cluster, self.assignment, self.me, self.timeout = cluster, assignment, me, timeout
        self.sent = Counter() if sent is None else sent  # bytes this node put into reduces, as Comm.sent
        self.make_group = make_group  # --transport nccl: NCCL groups (None: gloo's)
        self.hang_timeout = hang_timeout  # of the groups' operations
        self.failover = failover  # gives up (or aborts the iteration) on what no regroup can mend
        self.P, self.D = assignment.depth, len(assignment.pipelines)
        self.pipeline = assignment.slot(me)[0]
        self._groups: dict[str, tuple] = {}  # store key -> the group (kept for the epoch)
        self._opening: dict[str, Opening] = {}  # store key -> a group's opening a wait was called away from
        self._left: dict[tuple[int, str], tuple] = {}  # (iteration, key) -> (work, its buffer) left pending

    def members(self, stage: int) -> tuple[int, ...]:
        """The owner of `stage` in every pipeline now. A pipeline left without a copy
        of `stage` (two neighbours dead, or its owner with --redundancy off) cannot
        finish the iteration: no owner of it would ever come to the group, and a
        member waiting for one (a node of a short pipeline reducing two stages in
        turn) would hold up the rest, so the iteration is abandoned at once."""
        failed = self.cluster.failed()
        out = []
        for j, pipe in enumerate(self.assignment.pipelines):
            if stage in self.assignment.lost(j, failed, self.failover.redundancy):
                self.failover.unsurvivable(f"pipeline {j} holds no copy of stage {stage}")
            try:
                out.append(pipe[Layout(self.P, self.assignment.local_failed(j, failed)).owner(stage)])
            except ScheduleError as e:
                self.failover.unsurvivable(f"pipeline {j}: {e}")
        return tuple(out)

    def owners(self, stages) -> tuple[int, ...]:
        """The nodes that own `stages` in this node's pipeline now, each once."""
        pipe = self.assignment.pipelines[self.pipeline]
        try:
            layout = Layout(self.P, self.assignment.local_failed(self.pipeline, self.cluster.failed()))
            return tuple(sorted({pipe[layout.owner(s)] for s in stages}))
        except ScheduleError as e:
            self.failover.unsurvivable(f"pipeline {self.pipeline}: {e}")

    def _group(self, iteration: int, key: str, members: tuple[int, ...]):
        """The group at `key`, opened (a rendezvous every member must come to) on a
        thread: a node called away from the wait (Interrupted, as from a reduce)
        waits on the same opening when it comes back. A member opening a group for
        the stage it reduces first may wait for this node, which must then be free
        to take a dead peer's stage over and come to that group."""
        if key not in self._groups:
            silent = lease_check(self.cluster, members, iteration, self.me)

            def why_not():  # a member that aborted the iteration will never come: Aborted
                self.failover.check_abort()
                return silent()

            def give_up():
                reason = why_not()
                if not reason and self.failover.poll() is not None:
                    raise Interrupted(f"called away from opening group {key}")
                return reason
            if key not in self._opening:
                self._opening[key] = start_group(self.cluster, key, members, self.me, why_not, self.hang_timeout,
                                                 self.make_group)
            self._groups[key] = self._opening[key].wait(give_up)
            del self._opening[key]
        return self._groups[key][0]

    def close(self) -> None:
        """The epoch is over, or its iteration abandoned: an NCCL group's collective
        left pending would never end (and its communicator holds GPU memory)."""
        for key in list(self._groups):
            self._drop(key)
        self._left, self._opening = {}, {}

    def _drop(self, key: str) -> None:
        """Forget a group whose collective failed (a member died); an NCCL one is
        aborted, as its pending collective would otherwise never end."""
        self._opening.pop(key, None)
        entry = self._groups.pop(key, None)
        if entry is not None and self.make_group is not None:
            entry[0].abort()

    def tie(self, iteration: int, stages, grad) -> None:
        """Sum, in place, `grad` (this node's copies of a tied weight, already added
        up) with the other owners' in this pipeline."""
        members = self.owners(stages)
        done = self.cluster.get(TIED(iteration, self.pipeline))
        if done is not None and done.members != members and set(done.members) & set(members) - {self.me}:
            # an owner that summed with a partner now dead went on to its step: it will not sum again
            self.failover.unsurvivable(f"a node died after summing the tied weight's gradients in iteration "
                                       f"{iteration} and before its step: its copy's share is lost")
        if members == (self.me,):
            return
        key = tie_store(self.assignment.epoch, self.pipeline, members)
        try:
            work, summed = self._tie_work(iteration, key, members, grad)
            try:  # a death elsewhere in the pipeline may need this node's report first
                self._wait(work, iteration, members, leave=lambda: self.failover.poll() is not None)
            except Interrupted:
                self._left[(iteration, key)] = (work, summed)
                raise
            if summed is not grad:
                grad.copy_(summed)
            self.cluster.put(TIED(iteration, self.pipeline), Reduced(members))
        except Aborted:
            raise
        except (RuntimeError, TimeoutError):  # the partner died: once recorded, replan
            self._drop(key)

            def recorded():
                self.failover.check_abort()
                self.cluster.record_silent(members, iteration, self.me)
                return self.owners(stages) != members
            self.cluster.wait_for(recorded, timeout=max(60.0, 20 * self.timeout),
                                  what="the tied weight's dead partner to be recorded", poll=0.05)
            raise Interrupted(f"tied weight: owners {members} changed") from None

    def _tie_work(self, iteration: int, key: str, members, grad) -> tuple:
        """The tie's allreduce and the buffer it sums into: the one left pending when
        a wait on it was interrupted, if any (the partner's one call pairs with it;
        a second call would wait forever), else a new one. The sum is the same:
        a death outside the tie's members changes none of their tied gradients."""
        return self._pending(iteration, key) or (self._group(iteration, key, members).allreduce([grad]), grad)

    def _reduce_work(self, iteration: int, key: str, members, module) -> tuple:
        """A stage's allreduce and the flat copy of its gradients it sums: the one left
        pending (as `_tie_work`), else a new one. A node waiting in its stage's
        reduce has run every backward of that stage in this iteration, so a death
        it is called away for leaves the gradients it sums unchanged."""
        left = self._pending(iteration, key)
        if left:
            return left
        flat = recipe.flat_grads(module.parameters())
        self.sent[REDUCE] += flat.numel() * flat.element_size()
        return self._group(iteration, key, members).allreduce([flat]), flat

    def _pending(self, iteration: int, key: str) -> tuple | None:
        """The (work, buffer) of `key` left pending in `iteration`, taken; older ones forgotten."""
        self._left = {k: v for k, v in self._left.items() if k[0] == iteration}
        return self._left.pop((iteration, key), None)

    def allreduce(self, iteration: int, stage: int, module) -> None:
        if self.D == 1:
            return
        tries = 0
        while True:
            members = self.members(stage)
            # the sum may be done already only for a taker of a dead member's stage, or after a failed try
            done = self.cluster.get(REDUCED(iteration, stage)) if tries or self.failover.now.recovered else None
            tries += 1
            if done is not None and done.members != members:  # the sum is done: lent, as its record says
                flat, members = self._lent_sum(iteration, stage), done.members
                break
            key = reduce_store(self.assignment.epoch, stage, members)
            try:
                work, flat = self._reduce_work(iteration, key, members, module)
                try:  # a death in this node's pipeline may need its report first (its peers may wait on it)
                    self._wait(work, iteration, members, leave=lambda: self.failover.poll() is not None)
                except Interrupted:
                    self._left[(iteration, key)] = (work, flat)
                    raise
                break
            except (Aborted, Interrupted):
                raise
            except (RuntimeError, TimeoutError):  # a member died: wait until it is recorded, then regroup
                # The next try opens a new group (the failed one stays open until the
                # process exits: bamboo/transport/groups.py keeps every group).
                self._drop(key)

                def regrouped():
                    self.failover.check_abort()
                    self.cluster.record_silent(members, iteration, self.me)
                    return self.members(stage) != members or self.cluster.get(REDUCED(iteration, stage))
                try:
                    self.cluster.wait_for(regrouped, timeout=max(60.0, 20 * self.timeout),
                                          what=f"the failed member of stage {stage}'s group to be recorded", poll=0.05)
                except TimeoutError as e:  # e.g. both recorders died between the sum and its record
                    self.failover.unsurvivable(f"stage {stage}'s reduce of iteration {iteration} can neither be "
                                               f"done again nor found done: {e}")
        if self.failover.loans is not None:  # another pipeline's taker of the stage may borrow the sum
            self.failover.loans.keep(REDUCED_SUM, stage, iteration, flat)
        recipe.set_flat_grads(module.parameters(), flat)
        if self.me in members[:RECORDERS]:
            self.cluster.put(REDUCED(iteration, stage), Reduced(members))

    def _lent_sum(self, iteration: int, stage: int):
        """The sum of a reduce a member of this pipeline took part in before it died:
        this pipeline's share is in it, and only the other pipelines' owners have it
        (bamboo/runtime/lending.py). Without one to lend it the iteration is lost."""
        loans = self.failover.loans
        try:
            if loans is None or not loans.lends:
                raise NoLender("one pipeline")
            flat = loans.borrow(REDUCED_SUM, stage, self.pipeline, self.failover.lender_alive)
        except NoLender as e:
            self.failover.unsurvivable(f"a node died after its data-parallel reduce of stage {stage} in iteration "
                                       f"{iteration} and before its replica had the reduced gradients: its share of "
                                       f"the sum is lost ({e})")
        self.failover.record_loan()
        return flat

    def _wait(self, work, iteration: int, members: tuple[int, ...], leave=lambda: False) -> None:
        """Wait for the allreduce, noticing meanwhile an abort, a member gone silent
        (paused: its socket stays open and gloo would wait on), or `leave()`
        (Interrupted: the work stays pending)."""
        checked = time.monotonic()
        while not work.is_completed():
            time.sleep(0.001)
            if time.monotonic() - checked > 0.05:
                checked = time.monotonic()
                self.cluster.progress()
                self.failover.check_abort()
                silent = self.cluster.record_silent(members, iteration, self.me)
                if silent:
                    raise RuntimeError(f"nodes {silent} of the reduce group went silent")
                if leave():
                    raise Interrupted("called away from the allreduce")
        work.wait()
