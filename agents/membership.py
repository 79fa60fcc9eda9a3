"""The agents' part of the job's control plane (bamboo/control/protocol.py names the keys):
which nodes exist, in which zones, and which configuration runs next.

The leading agent decides (`Membership.leads`: the first registered member): it reads
the keys and runs the pure policy, and the create-if-absent write of the next epoch
lets exactly one decision stand, should two agents lead for a moment. The others
read only who leads, and their own release (agents/release.py `Releaser.follow`).
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import asdict

from agents.modes import ModeStats, epoch_setting, observe, setting_for
from agents.policy import Config, Priced, next_config, slot_estimate
from bamboo.control.assignment import WHY_CHARS, Assignment, Restore
from bamboo.control.changes import Changes
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig, Surplus, ZoneSpread
from bamboo.control.liveness import Heartbeat, lease_ages
from bamboo.control.protocol import (ABORT, ABORTED, ALIVE, ASSIGNMENT, CONFIG, COPIES, DONE, DRAIN, FAILED,
                                     HANDOVER, HOST_LOST, IDS, ITERATION_FAMILIES, LEASE_EXPIRED, MEMBERS, MODE,
                                     REGROUP, START, ZONES, Failure, Mark, Member, ModeChoice, Timestamp, Zone)
from bamboo.data.checkpoint_files import latest, newest_listed, storage_for
from bamboo.state.copies import newest_covered


def to_policy(a: Assignment) -> Config:
    return Config(a.epoch, a.depth, tuple(tuple(str(n) for n in p) for p in a.pipelines),
                  tuple(str(n) for n in a.standby))


LOOK_EVERY = 1.0  # an agent looks at etcd at least this often, whatever its watch says


def from_policy(c: Config, start: int, failed, gone=None, restore: Restore = Restore.PEERS) -> Assignment:
    failed = tuple(sorted(int(n) for n in failed))
    return Assignment(c.epoch, start, tuple(tuple(int(n) for n in p) for p in c.pipelines),
                      tuple(int(n) for n in c.standby), failed,
                      failed if gone is None else tuple(sorted(int(n) for n in gone)), restore)


def lost_everywhere(assignment: Assignment, failed, redundancy: str, taken=None) -> frozenset[int]:
    """Stages no live node holds once `failed` died: lost in every pipeline
    (`taken`: see Assignment.holders)."""
    lost = frozenset(range(assignment.depth))
    for j in range(len(assignment.pipelines)):
        lost &= assignment.lost(j, failed, redundancy, taken)
    return lost


def process_started() -> float:
    """Wall clock when this process started, where its paid time begins (Linux: its
    start in clock ticks after boot, and the boot from the uptime, both to 10 ms);
    elsewhere, now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            booted = time.time() - float(f.read().split()[0])
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class Membership:
    def __init__(self, cluster: Cluster, zone: str, node: int | None, cfg: JobConfig, host: str | None = None):
        """`host`: the machine this node shares with others (bamboo-agent --host);
        None: a machine of its own, named by its hostname."""
        self.cluster, self.zone, self.cfg, self.given_host = cluster, zone, cfg, host
        cluster.fenced_as = None  # a new identity is claimed by a process that may have had an old one
        self.node = node if node is not None else self._claim_id()
        if node is not None and not cluster.create(IDS(node), Mark()):
            raise ValueError(f"node id {node} is taken in this job")
        cluster.fenced_as = self.node  # from now on etcd refuses this agent's writes once the node is dead
        cluster.put(ZONES(self.node), Zone(zone, host or "", process_started()))
        host = self.host = host or socket.gethostname()
        self.fenced_why: str | None = None  # set by the heartbeat's thread: this node was recorded dead
        self.heartbeat = Heartbeat(cluster, MEMBERS(self.node), lambda lease: Member(zone, host, lease),
                                   cfg.faults.lease_ttl, cfg.faults.failure_timeout,
                                   fenced=lambda: cluster.death_of(self.node), on_fenced=self._fenced)
        cluster.heartbeat = self.heartbeat  # the agent judges peers' silence by lease age, as workers do
        self.failure_timeout = cfg.faults.failure_timeout
        self._dead_seen: dict[int, float] = {}  # node -> when this agent first read it dead (host mates' judge)
        self._drained = False
        self._epoch: int | None = None  # the newest assignment seen
        self._next = 0                  # the first iteration whose regroup records are not settled
        self._observed: int | None = None  # --redundancy auto: the last iteration folded into the mode stats
        # What a decision reads changes under these prefixes: a regroup per iteration, an epoch, a
        # join (each looked at once: `routine`, watched by the leader alone, `_lead`); a death's keys
        # (then every round for a while: what follows a death, a lease aging or a host's mates going
        # silent, writes nothing); else every LOOK_EVERY. Armed while this agent decides for the job (leads).
        self.routine: Changes | None = None
        self.events = cluster.changes(FAILED(), ABORT(), ABORTED(), DRAIN())
        self.events.take()  # armed: the first round looks anyway, no death's aftermath to watch yet
        # Who leads changes only when a member with a lower id (or this one) joins or leaves: etcd
        # sends this agent no other member's news (every agent hearing every join grew as N x N).
        self.members = cluster.changes(MEMBERS(), until=MEMBERS(self.node + 1))
        self._next_in_line = False  # this agent leads should the leader go: it judges the leader's lease
        self._leader_judged = float("-inf")  # when it last did
        self._looked = float("-inf")  # when `due` last said to look
        self._busy_until = float("-inf")  # every round looks until then: an event's aftermath

    def wait(self, seconds: float) -> None:
        """The pause between an agent's rounds, cut short by a regroup, an epoch or a
        join: the mode wanted after an iteration is then written before the next
        boundary reads it; for an agent that does not lead, by a change of who leads."""
        (self.routine or self.members).wait(seconds)

    @property
    def leading(self) -> bool:
        """Whether this agent decided for the job when it last asked (`leads`)."""
        return self.routine is not None

    def leads(self) -> bool:
        """Whether this agent decides for the job: its node is the first registered
        member (the lowest id whose lease lives). Only the leader reads what a
        decision needs: every agent reading every prefix grew as N x N. A leader
        that dies leaves with its lease, and the next one's first round looks at
        everything; two agents that both lead for a moment are harmless, as every
        decision is a first writer's."""
        now = time.monotonic()
        if self.members.take() or (self._next_in_line and now - self._leader_judged >= LOOK_EVERY):
            self._leader_judged = now
            first = self.cluster.firsts(MEMBERS(), 2)
            leading = bool(first) and first[0] == self.node
            if leading != self.leading:
                self._lead(leading)
            self._next_in_line = first[1:] == [self.node]
            if self._next_in_line:
                self._judge_leader(first[0])
        return self.leading

    def _lead(self, leading: bool) -> None:
        """A new leader watches what its decisions read, and looks at once; one that
        no longer leads stops watching it."""
        if leading:
            self.routine = self.cluster.changes(REGROUP(), START(), ASSIGNMENT(), MEMBERS(), HANDOVER())
            self._looked = float("-inf")
        else:
            self.routine.close()
            self.routine = None

    def _judge_leader(self, leader: int) -> None:
        """The next in line records a leader whose lease went unrefreshed for the
        failure timeout dead (its keys go with it, and the next leads): a leader
        with no worker (in standby) that vanished has nobody else to find it
        silent, and its lease would stand for --lease-ttl."""
        member = self.cluster.get(MEMBERS(leader))
        if member is None or not member.lease or not self.heartbeat.judging():
            return
        age = lease_ages(self.cluster, {leader: member.lease}).get(leader, 0.0)
        if age > self.failure_timeout:
            regroups = self.cluster.firsts(REGROUP(), 1, last=True)
            it = regroups[0][0] + 1 if regroups else 0
            self.cluster.record_dead(leader, Failure(it, self.node, LEASE_EXPIRED))

    def due(self) -> bool:
        """Whether to look at etcd now (decide, observe the modes): a regroup, an
        epoch or a join came, a death's key changed within the failure timeout and a
        second, or LOOK_EVERY passed. An agent that read every prefix at every round of its
        monitor made hundreds of requests a second in a job that nothing disturbs."""
        now = time.monotonic()
        events = self.events.take()
        if not self.leads():
            return False
        routine = self.routine.take()
        if events:
            self._busy_until = now + self.failure_timeout + LOOK_EVERY
        if routine or now < self._busy_until or now - self._looked >= LOOK_EVERY:
            self._looked = now
            return True
        return False

    def _fenced(self, reason: str) -> None:
        self.fenced_why = reason

    def successor(self) -> "Membership":
        """This machine under a new node id, holding nothing: how a node recorded
        dead comes back (its old id is never registered again)."""
        self.leave()
        return Membership(self.cluster, self.zone, None, self.cfg, self.given_host)

    def _claim_id(self) -> int:
        n = len(self.cluster.children(IDS()))
        while not self.cluster.create(IDS(n), Mark()):
            n += 1
        return n

    def live(self, exclude=()) -> dict[str, str]:
        """node -> zone of the registered nodes, without `exclude` and the draining."""
        gone = {int(n) for n in exclude} | set(self.cluster.children(DRAIN()))
        return {str(n): m.zone for n, m in self.cluster.children(MEMBERS()).items() if n not in gone}

    def hosts(self) -> dict[str, str]:
        """node -> host of the nodes that share a machine (the policy's `hosts`)."""
        return {str(n): z.host for n, z in self.cluster.children(ZONES()).items() if z.host}

    def first_assignment(self, nodes: list[int]) -> None:
        """Run by the rendezvous' rank 0: assignment 0 over the nodes that met, from
        the job's first iteration, or with --resume from the newest complete
        checkpoint's (which the workers load: Worker.join)."""
        zones = self.cluster.children(ZONES())
        live = {str(n): zones[n].zone for n in nodes}
        cfg = self.cluster.get(CONFIG())
        config = self._policy(cfg, live, None)
        first = from_policy(config, self._resumed(cfg), ())
        mode, sync = setting_for(cfg, first, ModeStats())
        self.cluster.create(ASSIGNMENT(0), Assignment(**{**first.__dict__, "redundancy": mode, "sync": sync}))

    @staticmethod
    def _resumed(cfg: JobConfig) -> int:
        """The iteration a job starts from: with --resume its newest complete
        checkpoint's (found by listing: the workers read it, Worker.join), else 0
        (also when there is none, or storage does not answer: the workers then
        look themselves and stop with that error)."""
        if not cfg.checkpoints.resume:
            return 0
        try:
            found = newest_listed(storage_for(cfg.checkpoints.checkpoint), cfg.model.layers)
        except (OSError, ValueError) as e:  # ValueError: objects.ObjectError
            print(f"bamboo-agent: --resume: {cfg.checkpoints.checkpoint}: {str(e).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
            return 0
        return found or 0

    def decide(self, cfg: JobConfig) -> None:
        """If the workers asked for a new configuration after some iteration, or
        abandoned one, and none exists yet, write it (first writer wins)."""
        if not self.cluster.assignments():
            return
        latest = self.cluster.latest_assignment()
        if latest.epoch != self._epoch:  # a new epoch: what came before it is settled
            self._epoch, self._next = latest.epoch, latest.start
        aborted = self.cluster.children(ABORT())
        if aborted:
            self._redo(cfg, latest, min(aborted), aborted[min(aborted)].why)
            return
        while True:
            tries = self.cluster.children(REGROUP(self._next))
            if not tries:
                self._orphaned(cfg, latest, self._next)
                return
            asked = [r for r in tries.values() if r.reconfigure]
            if asked and self._next + 1 < cfg.schedule.iterations:
                previous = self.cluster.latest_assignment()
                if previous.start <= self._next:
                    failed = asked[0].failed
                    gone = self._host_losses(failed, self._next)
                    if gone is None:
                        return  # a node of a dead one's host may be gone too: wait until that is known
                    self._next_epoch(cfg, previous, self._next, failed, gone, redo=False)
            if not self.cluster.children(REGROUP(self._next + 1)):
                self._orphaned(cfg, self.cluster.latest_assignment(), self._next + 1)
                return  # this iteration may still get another try
            self._next += 1

    def _orphaned(self, cfg: JobConfig, latest: Assignment, it: int) -> None:
        """Every member of the epoch in force gone in iteration `it` before any
        wrote an abort or a regroup (only its workers write those: a burst took
        them all at once, even after some reported the iteration done): record
        them dead and redo `it` over the nodes left, from copies or a checkpoint,
        rather than wait for no one."""
        if it >= cfg.schedule.iterations or latest.start > it:
            return
        workers = self.cluster.children(ALIVE())
        if any(n in workers for n in latest.members):
            return  # a worker of the epoch runs: it reports or aborts
        failed = self.cluster.failed()
        done = self.cluster.children(DONE(it))
        if it == cfg.schedule.iterations - 1 and done and all(n in done or n in failed for n in latest.members):
            return  # the job's last iteration finished: its workers are leaving, not gone
        left = [n for n in latest.members if n not in failed]
        if left and self.cluster.record_silent(left, it, self.node, starting=left) != sorted(left):
            return  # an agent whose worker is still starting: not gone
        self._redo(cfg, latest, it, f"every member of epoch {latest.epoch} gone in iteration {it} before any "
                                    "wrote an abort")

    def _redo(self, cfg: JobConfig, previous: Assignment, it: int, why: str) -> None:
        """Iteration `it` was abandoned. Once every live node has undone its steps,
        configure the survivors to redo it from their copies, or, when a stage has
        no copy left on any node, from the newest complete checkpoint. (Another
        agent may get there first: its transaction then clears what this one read.)"""
        acked = set(self.cluster.children(ABORTED(it)))
        failed = set(self.cluster.failed())
        waiting = [n for n in previous.members if n not in failed and n not in acked]
        if waiting:  # a node that died without a record would hold everyone up; one whose
            # worker has not registered yet (a newcomer, still starting) is alive while its agent is
            self.cluster.record_silent(waiting, it, self.node, starting=waiting)
            return
        if self.cluster.record_silent([n for n in previous.members if n not in failed], it, self.node):
            return  # one that acknowledged died since: its layers are gone too; decide again with its record
        failed = self._host_losses(failed, it)
        if failed is None:
            return  # a node of a dead one's host may be gone too: wait until that is known
        basis, before = previous, previous.gone
        if not self._entered(previous):  # no node entered it: the layers are where they were
            basis, before = self.cluster.get(ASSIGNMENT(previous.layers_from)), previous.failed
        elif it > previous.start:  # the failures the nodes' layers reflect at the start of `it`
            tries = self.cluster.children(REGROUP(it - 1))
            if not tries:
                return  # cleared: another agent decided
            before = tries[max(tries)].failed
        self._next_epoch(cfg, previous, it, before, failed, redo=True, basis=basis, why=why)

    def _entered(self, epoch: Assignment) -> bool:
        """Whether the nodes entered `epoch` (hold their layers as it lays them out):
        its layers came from no handover, or its handover completed."""
        if epoch.layers_from < 0 or epoch.restore not in (Restore.PEERS, Restore.MEMORY):
            return True
        outcome = self.cluster.get(HANDOVER(epoch.epoch))
        return outcome is not None and outcome.complete

    def _next_epoch(self, cfg: JobConfig, previous: Assignment, it: int, before, failed, redo: bool,
                    basis: Assignment | None = None, why: str = "") -> None:
        """Write the epoch after iteration `it` (before it, with `redo`): the policy
        over the live nodes; layers from the survivors, whose holdings follow the
        layout of `basis` (default: `previous`) after the failures `before`, or,
        when some stage is held by no live node, from the newest complete
        checkpoint, in the live nodes' memory or else in storage (the iterations
        after it are run again). `why`: a redo's cause, kept in the epoch (abort/<it>
        is cleared with the iteration)."""
        taken = self._taken(cfg, previous, basis, it, redo)
        basis = basis or previous
        config = self._policy(cfg, self.live(failed), to_policy(previous))
        if config.depth < 2:
            return  # a pipeline needs two nodes: wait for more (the workers wait for this epoch)
        start, restore = (it if redo else it + 1), Restore.PEERS
        if lost_everywhere(basis, set(before) | set(failed), basis.mode(cfg.schedule.redundancy), taken):
            holders = (set(basis.members) | {int(n) for p in config.pipelines for n in p}) - set(failed) - set(before)
            (start, restore), redo = self._restore_point(cfg, start, holders), True
            why = why or f"no live node holds a current copy of every stage: restored from {restore}"
        new = from_policy(config, start, before, failed, restore)
        wanted = self.cluster.get(MODE(it - 1))  # what the boundary of `it` compared with (auto)
        mode, sync = setting_for(cfg, new, ModeStats(**wanted.stats) if wanted else None, wanted)
        new = Assignment(**{**new.__dict__, "redo": redo, "layers_from": basis.epoch, "redundancy": mode,
                            "sync": sync, "taken": None if taken is None else tuple(sorted(taken)),
                            "why": why[:WHY_CHARS]})
        clear = [(family(start), family(it + 1)) for family in ITERATION_FAMILIES]  # iterations start..it
        self.cluster.create_clearing(ASSIGNMENT(new.epoch), new, clear)

    def _policy(self, cfg: JobConfig, live: dict[str, str], previous: Config | None) -> Config:
        """The policy's next configuration for this job (pipelines: each needs a microbatch)."""
        s = cfg.schedule
        return next_config(live, previous, s.stages, s.microbatches, s.max_stages_per_node,
                           slot_estimate(s.microbatches), hosts=self.hosts(),
                           priced=Priced(per_node=cfg.cluster.surplus != Surplus.KEEP,  # no pipeline's nodes released
                                         pack_zones=cfg.cluster.zone_spread == ZoneSpread.PACK))

    def _taken(self, cfg: JobConfig, previous: Assignment, basis: Assignment | None, it: int,
               redo: bool) -> tuple[int, ...] | None:
        """--replica-sync next: the dead whose stage a survivor took over inside the
        last iteration that completed in `previous` (its takers' failover events), the
        only dead whose stage a live node holds up to date (Assignment.holders). Any
        other death (in a sync's window, or between iterations) took the stage's
        newest weights along. None where every replica counts: with the sync at the
        end, and after an epoch's first iteration was undone (nothing was owed)."""
        if not cfg.schedule.late_in(previous):
            return None
        if basis is not None and basis is not previous:  # nobody entered `previous`: its basis's holds
            return previous.taken
        if redo and it == previous.start:  # its first iteration, undone: every replica came from its owner
            return None
        last = it - 1 if redo else it
        reports = self.cluster.children(DONE(last)).values()
        return tuple(sorted({e["node"] for r in reports for e in r.events if e["type"] == "failover"}))

    def observe_modes(self, cfg: JobConfig) -> None:
        """--redundancy auto or --replica-sync auto: fold every iteration whose
        boundary was reached into the job's observations and record the mode and
        sync wanted after it (MODE, first writer wins; every agent computes the same
        from the same keys)."""
        if not cfg.schedule.chooses:
            return
        if self._observed is None:
            first = self.cluster.get(START())
            if first is None:
                return
            self._observed = first.iteration - 1
        while tries := self.cluster.children(REGROUP(self._observed + 1)):
            it = self._observed + 1
            if self.cluster.get(MODE(it)) is None:
                self.cluster.create(MODE(it), self._observation(cfg, it, agreed_costs(tries)))
            self._observed = it

    def _observation(self, cfg: JobConfig, it: int, costs: dict | None) -> ModeChoice:
        reports = self.cluster.children(DONE(it))
        epoch = self.cluster.assignment_at(it)
        before = self.cluster.get(MODE(it - 1))
        ran = epoch_setting(cfg.schedule, epoch)
        disturbed = epoch.start == it or any(r.events for r in reports.values())  # a new epoch: its handover
        stats = observe(ModeStats(**before.stats) if before else ModeStats(), max(r.time for r in reports.values()),
                        len(reports), len(self.cluster.failed()), ran, disturbed, costs)
        mode, sync = setting_for(cfg, epoch, stats)
        return ModeChoice(mode, asdict(stats), sync)

    def _restore_point(self, cfg: JobConfig, start: int, holders=()) -> tuple[int, Restore]:
        """(iteration, restore) to go back to when a stage is lost on every node: the
        newest checkpoint whose copies in the memory of `holders` (the live nodes
        that take part) cover every layer ("memory": bamboo/state/copies.py),
        unless storage holds a newer complete one, which the workers load by name
        ("checkpoint"); or, before the first, the job's first iteration, whose
        layers every node builds again from the seed ("initial"). A job resumed
        from a checkpoint that is gone since cannot go back: the workers stop with
        that error."""
        # taken before `start` at the latest: a newer one is from an earlier run of
        # these iterations (before the job went back to its start, say)
        kept = newest_covered(self.cluster.children(COPIES()), holders, cfg.model.layers, at_most=start)
        storage = storage_for(cfg.checkpoints.checkpoint) if cfg.checkpoints.checkpoint else None
        found = latest(storage, cfg.model.layers, at_most=start, above=kept) if storage else None  # only newer ones
        if kept is not None and found is None:
            return kept, Restore.MEMORY
        if found:
            return found[0], Restore.CHECKPOINT
        first = self.cluster.get(START())
        if not cfg.checkpoints.resume and (first is None or first.iteration == 0):
            return 0, Restore.INITIAL
        return start, Restore.CHECKPOINT

    def _host_losses(self, failed, it: int) -> set[int] | None:
        """`failed` and the nodes of their hosts that died with them (recorded
        HOST_LOST), so that a host's loss is one reconfiguration; None while such a
        node is neither silent (its agent's lease unrefreshed for the failure
        timeout) nor seen alive (refreshed since this agent saw the death)."""
        failed = {int(n) for n in failed}
        now = time.monotonic()
        for n in failed:
            self._dead_seen.setdefault(n, now)
        places, members = self.cluster.children(ZONES()), self.cluster.children(MEMBERS())
        seen: dict[str, float] = {}  # host -> when its newest death was first seen
        for n in failed:
            if n in places and places[n].host:
                seen[places[n].host] = max(seen.get(places[n].host, 0.0), self._dead_seen[n])
        mates = {n: m.lease for n, m in members.items()
                 if n not in failed and m.lease and n in places and places[n].host in seen}
        ages = lease_ages(self.cluster, mates)
        lost, waiting = set(), False
        for n in mates:
            age = ages.get(n, 0.0)  # etcd did not answer: not known yet
            if age > self.failure_timeout and self.heartbeat.judging():
                lost.add(n)
            elif age + 1 >= now - seen[places[n].host]:  # (whole seconds) not refreshed since, as far as known
                waiting = True
        if waiting:
            return None
        for n in sorted(lost):
            self.cluster.record_dead(n, Failure(it, self.node, HOST_LOST))
        return failed | lost

    def drain(self) -> None:
        if not self._drained:
            self.cluster.put(DRAIN(self.node), Timestamp(time.time()))
            self._drained = True

    def job_finished(self) -> bool:
        cfg = self.cluster.get(CONFIG())
        return bool(self.cluster.children(DONE(cfg.schedule.iterations - 1)))

    def leave(self) -> None:
        self.heartbeat.stop()
        if self.routine is not None:
            self.routine.close()
        self.events.close()
        self.members.close()


def agreed_costs(tries: dict) -> dict | None:
    """The cost model a boundary (its tries: try -> Regroup) agreed from the nodes'
    measured op times, its first pipeline's (CostModel keywords), if it agreed one."""
    costs = tries[max(tries)].costs if tries else None
    found = costs.get("0") if isinstance(costs, dict) else None
    return found if isinstance(found, dict) else None
