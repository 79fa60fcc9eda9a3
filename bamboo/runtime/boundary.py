"""The iteration boundary: every node reports, and the first to see every live
node's report writes what the next iteration runs with (REGROUP: the failed set,
whether the agents reconfigure first, whether to checkpoint). Every node reads
that one record. Without a reconfiguration the world group is rebuilt without
the dead; a node that dies meanwhile makes a new try, with its own record.

The reports also say how long each node computed. A node that computed far
longer than its peers (a straggler: throttled, starved, on a failing machine)
is recorded dead here, as if it had gone silent, and the next iteration runs
without it.

It is to the iteration's end what bamboo/runtime/failover.py is to its middle."""
from __future__ import annotations

import itertools
import random
import statistics
import time

from bamboo.control.assignment import Assignment
from bamboo.control.changes import Changes
from bamboo.control.cluster import SPANS_AT_ONCE, Cluster
from bamboo.control.exits import Fenced
from bamboo.control.protocol import (ABORT, CHECKPOINTED, DONE, DRAIN, FAILED, MEMBERS, MODE, REGROUP, STRAGGLER,
                                     Failure, NodeId, Regroup, Report, Timestamp)
from bamboo.runtime.calibration import propose
from bamboo.state.checkpoint import Checkpoints
from bamboo.runtime.failover import LEASE_WAIT, LINGER_WAKE, Aborted
from bamboo.runtime.watch import Completed

LINE_ASKERS = 2  # nodes after the boundary's leader that ask its lease first (see Boundary._patience)


def stragglers(reports: dict[NodeId, Report], factor: float, slack: float) -> list[NodeId]:
    """The nodes whose compute time in one iteration exceeds both `factor` times the
    median of their peers' and that median plus `slack` seconds. Iterations with a
    failover are not judged: a node that took over a dead peer's work computes more."""
    if factor <= 0 or len(reports) < 2 or any(r.events for r in reports.values()):
        return []
    slow = []
    for node, report in reports.items():
        peers = statistics.median(r.busy for n, r in reports.items() if n != node)
        if report.busy > max(factor * peers, peers + slack):
            slow.append(node)
    return sorted(slow)


class Boundary:
    def __init__(self, cluster: Cluster, node: NodeId, elastic: bool, checkpoints: Checkpoints,
                 straggler_factor: float = 0.0, straggler_slack: float = 0.0, auto: bool = False,
                 changes: Changes | None = None):
        self.cluster, self.node, self.elastic = cluster, node, elastic
        self.changes = changes  # raised by a watch on failed/, abort/ and regroup/ (None: read every 20 ms)
        self.leading: Changes | None = None  # the same and done/, armed once this node first leads
        self.reports: tuple[dict, int] = ({}, 0)  # a leader's: the reports read so far, and etcd's revision then
        self.auto = auto  # --redundancy or --replica-sync auto: the agents may want another setting (agents/modes.py)
        self.checkpoints = checkpoints  # says whether a checkpoint is due
        self.straggler_factor, self.straggler_slack = straggler_factor, straggler_slack
        self.seen: tuple[dict, dict] | None = None  # (reports, deaths) read with this node's report
        self.unwritten: dict = {}  # {DONE key: report} of a pipeline this node completed, not yet written
        self.armed = False  # the watch's flag was lowered at the iteration's start (arm) and nothing read since
        self._order: tuple = (None, [])  # ((iteration, members), the order the others ask in): _ask_order

    def arm(self) -> None:
        """At an iteration's start: the watch's flag lowered, so that a node whose
        report its pipeline's collector writes (report(reported=True)) looks at etcd
        once the agreement, a death or an abort came, and not once more before."""
        if self.changes is not None:
            self.changes.take()
            self.armed = not self.changes.lost

    def report(self, iteration: int, report: Report, completed: Completed | None = None,
               reported: bool = False) -> None:
        """This node's report, written with a read of the reports and deaths so far
        (one round trip), which the wait for the others starts from; nothing when
        it was `reported` with its pipeline's marks (bamboo/runtime/marks.py).

        `completed`: what this node read with its finished mark, when that mark
        completed a pipeline with no death in the iteration. Nothing more can happen
        to the pipeline in it, so the reports the marks carry are final: they go to
        etcd with the regroup record, or before the first wait for another
        pipeline's, and nobody waits for the pipeline's other nodes to wake from
        their linger and write theirs."""
        if reported:
            self.seen = None
            return
        self.armed = False  # this node reads with its report, lowering the flag again
        if completed is not None:
            final = {n: Report.from_dict(mark.report) for n, mark in completed.marks.items()
                     if mark.report is not None}
            final[self.node] = report
            self.unwritten = {DONE(iteration, n): r for n, r in final.items()}
            # no take(): the watch's flag stays up, so a report written since the mark is read
            self.seen = ({**completed.reports, **final}, completed.deaths)
            return
        if self.changes is not None:
            # lowered before the read: a report after it wakes the wait
            self.changes.take(own=DONE(iteration, self.node))
        self.seen = tuple(self.cluster.put_and_read(DONE(iteration, self.node), report, DONE(iteration), FAILED()))

    def agree(self, iteration: int, assignment: Assignment, failover, failed: tuple[NodeId, ...], regroup,
              idle=None) -> Regroup:
        """Wait for every live node's report and return the agreed record. When the
        failed set grew and the agents do not reconfigure, `regroup(failed, try)`
        rebuilds the world group; if a member dies meanwhile, the next try leaves it out.
        `idle()` is called once, if this node has to wait for the others' reports."""
        reports, dead, settled = self._wait_for_reports(iteration, assignment.members, failover, failed, idle)
        if settled is None:  # this node read every report: it judges the stragglers too
            dead |= set(self._record_stragglers(iteration, failed, reports))
        for attempt in itertools.count():
            if attempt == 0 and settled is not None:
                agreed = settled
            else:
                reports = reports if settled is None else self.cluster.children(DONE(iteration))
                agreed = self._decide(iteration, attempt, assignment, dead if attempt == 0 else None, reports)
            if self.node in agreed.failed:
                why = self.cluster.death_of(self.node)
                raise Fenced(why or f"node {self.node} was declared dead in iteration {iteration}")
            if agreed.reconfigure or agreed.failed == tuple(failed):
                return agreed
            failed = agreed.failed  # what the world is rebuilt without; a later try compares with it
            try:
                regroup(agreed.failed, attempt)
                return agreed
            except (RuntimeError, TimeoutError):
                continue  # a member died while regrouping: the next try leaves it out

    def _wait_for_reports(self, iteration: int, members, failover, failed: tuple[NodeId, ...],
                          idle=None) -> tuple[dict[NodeId, Report], set[NodeId], Regroup | None]:
        """Every live node's report and the dead as last read, read when a watch says
        a report or a death came; or, on a node that does not lead the boundary
        (`leader`, from the deaths agreed before: `failed`), the agreed record once
        it is written. Any node whose own report's read shows every report goes on
        at once (the last to finish writes the agreement in its next round trip), but
        only the leader reads the reports again as they come: N nodes reading N
        reports at each of N reports grew as N x N x N, and N nodes proposing, each
        reading every member, as N x N. A wake with nothing new (the watch's flag
        down) reads nothing. A node that died between its stream and its report is
        found by its lease, asked once a report is LEASE_WAIT late: the pending
        nodes' by the leader, the leader's by a few others, more of them only as
        the wait grows (`_patience`); once the leader is recorded dead, the next
        live one leads."""
        began = asked = time.monotonic()
        leading, pending = self.leader(members, failed) == self.node, list(members)
        looked_as = False if self.armed else None  # whether the last look was a leader's (None: none yet)
        self.armed = False
        done, settled = None, None  # nothing read yet (an armed node may wait before its first look)
        self.reports = ({}, 0)
        while True:
            if self.seen is not None:  # read with this node's own report
                (done, failed), settled, self.seen = self.seen, None, None
                failover.check_abort()  # another pipeline could not finish: this iteration is redone
            elif self._changed(leading) or looked_as != leading:
                done, failed, settled = self._look(iteration, leading)  # Aborted, as check_abort
                looked_as = leading
            if settled is not None:
                return done or {}, set(failed), settled
            if done is not None:  # every report so far
                pending = [n for n in members if n not in done and n not in failed]
            failover.serve_loans(failed)  # a pipeline still recovering may need this node's gradients
            if done is not None and not pending:
                return done, set(failed), None
            leader = self.leader(members, failed)
            leading = leader == self.node
            if self.unwritten:  # the others may be waiting for them
                self.cluster.put_all(self.unwritten)
                self.unwritten = {}
            self.cluster.progress()
            now = time.monotonic()
            waited = now - began  # (the patience, never under LEASE_WAIT, is worked out only past it)
            if now - asked > LEASE_WAIT and waited > LEASE_WAIT and \
                    waited > self._patience(iteration, members, leader, failed, failover.timeout):
                asked = now
                self._ask_leases(iteration, members, failed, pending, leader)
            if idle is not None:
                idle, work = None, idle
                work()
                continue  # what came in meanwhile is read before any wait
            self._wait(leading, failover.lending(failed))

    def _ask_leases(self, iteration: int, members, failed, pending, leader: NodeId) -> None:
        """The leader asks after the pending nodes' leases; another node after the
        leader's and, when the leader went silent, after the others ahead of it in
        line (a burst may have taken them too), up to SPANS_AT_ONCE at once: should
        they all be gone, this node leads next."""
        if leader == self.node:
            self.cluster.record_silent(pending, iteration, self.node)
        elif self.cluster.record_silent([leader], iteration, self.node):
            ahead = sorted(n for n in members if n not in failed and n < self.node)
            self.cluster.record_silent(ahead[1:SPANS_AT_ONCE], iteration, self.node)

    def _ask_order(self, iteration: int, members) -> list[NodeId]:
        """The members shuffled by iteration: the order in which the nodes that do not
        lead start asking after the leader's lease (`_patience`); kept for the wait."""
        key = (iteration, tuple(members))
        if self._order[0] != key:
            order = sorted(members)
            random.Random(iteration).shuffle(order)
            self._order = (key, order)
        return self._order[1]

    def _patience(self, iteration: int, members, leader: NodeId, failed, timeout: float) -> float:
        """Seconds this node waits at the boundary before it asks after leases. The
        leader, and the first LINE_ASKERS live others in `_ask_order`, ask at LEASE_WAIT;
        the next LINE_ASKERS a failure timeout (and LEASE_WAIT) later, by when the
        ones before would have recorded a dead leader; and so on. The order is a
        shuffle, so a burst that took a zone, or the line's head, leaves some early
        asker alive. A slow boundary costs a few lease asks, not one per node."""
        if leader == self.node:
            return LEASE_WAIT
        order = self._ask_order(iteration, members)
        before = order[:order.index(self.node)]
        rank = sum(1 for n in before if n not in failed and n != leader)
        return LEASE_WAIT + rank // LINE_ASKERS * (timeout + LEASE_WAIT)

    def leader(self, members, failed) -> NodeId:
        """The node that reads every report of an iteration and writes the agreement:
        the first member not known dead (every node computes it from what it read)."""
        return min((n for n in members if n not in failed), default=self.node)

    def _look(self, iteration: int, leading: bool) -> tuple[dict | None, dict, Regroup | None]:
        """(reports, deaths, the agreed record if written): a leader reads the reports,
        another node the agreement's first try (and no reports: None). Aborted when
        the iteration was abandoned (read with the deaths, in one request)."""
        if leading:  # the reports written since its last read (one pipeline's at a time), then the deaths
            known, revision = self.reports
            new, revision = self.cluster.changed_since(DONE(iteration), revision)
            self.reports = ({**known, **new}, revision)
            aborts, failed = self.cluster.read_with_aborts(range(iteration, iteration + 1), FAILED())
            reports, tries = dict(self.reports[0]), {}
        else:
            aborts, tries, failed = self.cluster.read_with_aborts(range(iteration, iteration + 1), REGROUP(iteration),
                                                                  FAILED())
            reports = None
        if iteration in aborts and self.elastic:
            raise Aborted(aborts[iteration].why)
        return reports, failed, tries.get(0)

    def _changed(self, leading: bool) -> bool:
        """Whether what a look reads may have changed since the last look: the watch's
        flag, lowered before the read (a change after it wakes the wait); always,
        without a watch."""
        watch = self._watch(leading)
        return watch.take() if watch is not None else True

    def _watch(self, leading: bool) -> Changes | None:
        """What a wait wakes on: only the leader's watch sees the reports (every node
        watching done/ would see every pipeline's, N x N events per iteration)."""
        if self.changes is None or not leading:
            return self.changes
        if self.leading is None:
            self.leading = self.cluster.changes(DONE(), FAILED(), ABORT(), REGROUP())
        return self.leading

    def _wait(self, leading: bool, lending: bool) -> None:
        """Until the watch says something changed, or LINGER_WAKE: for a node that does
        not lead, a report is no news (the agreement, a death or an abort is), and
        unless it may lend gradients it wakes only to ask after leases (LEASE_WAIT)."""
        if (watch := self._watch(leading)) is None:
            time.sleep(0.02)
            return
        watch.wait(LINGER_WAKE if leading or lending else LEASE_WAIT)

    def _record_stragglers(self, iteration: int, failed: tuple[NodeId, ...],
                           reports: dict[NodeId, Report]) -> list[NodeId]:
        """Every node judges the same reports (every live node's, less the nodes the
        last boundary agreed were dead), so each records the same stragglers."""
        reports = {n: r for n, r in reports.items() if n not in failed}
        slow = stragglers(reports, self.straggler_factor, self.straggler_slack)
        for n in slow:
            self.cluster.record_dead(n, Failure(iteration, self.node, STRAGGLER))
        return slow

    def _decide(self, iteration: int, attempt: int, assignment: Assignment, dead: set[NodeId] | None,
                reports: dict[NodeId, Report]) -> Regroup:
        """Propose this node's view (the dead as read after every report came, or
        read now), with the cost models the reports' op times give, if they do; the
        first proposal written stands for everyone."""
        failed = tuple(sorted(self.cluster.failed() if dead is None else dead))
        last = self.cluster.get(CHECKPOINTED()) if self.checkpoints.writer else None
        due = self.checkpoints.due(iteration, last.time if last else None)
        proposal = Regroup(failed, self._wants_change(assignment, failed) or self._mode_change(iteration, assignment),
                           due, propose(reports, assignment.pipelines))
        agreed, wrote = self.cluster.create_or_get(REGROUP(iteration, attempt), proposal, also=self.unwritten)
        self.unwritten = {}
        if wrote and due:
            self.cluster.put(CHECKPOINTED(), Timestamp(time.time()))
        return agreed

    def _mode_change(self, iteration: int, assignment: Assignment) -> bool:
        """--redundancy auto or --replica-sync auto: the agents, having seen the
        iteration before this one, want another mode or sync than this epoch's (the
        next epoch switches to it)."""
        wanted = self.cluster.get(MODE(iteration - 1)) if self.auto and iteration > 0 else None
        return wanted is not None and (wanted.mode, wanted.sync) != (assignment.redundancy, assignment.sync)

    def _wants_change(self, assignment: Assignment, failed: tuple[NodeId, ...]) -> bool:
        """Under agents: a node of this epoch died or is draining, or a node joined
        that the configuration does not know yet."""
        if not self.elastic:
            return False
        members = set(assignment.members)
        joined = set(self.cluster.children(MEMBERS()))
        draining = set(self.cluster.children(DRAIN()))
        known = members | set(assignment.standby) | set(failed)
        return bool(members & (set(failed) | draining) or (joined - known - draining))
