"""What the dashboard knows of one job, read from the job's etcd and nothing else.

The reader never writes: its Cluster is read-only, so a bug here raises rather
than changes what the job agrees on. A look is one etcd transaction: the small
families (epochs, deaths, zones, drains, notices) whole, and the iteration
families only from the first iteration not yet complete on, at most CHUNK
iterations of them (a long job's first look takes more, a piece at a time). A
complete iteration is kept as a few numbers (`Finished`), so what a look asks of
etcd is as small on day three as in minute one. A redo epoch clears the keys of
the iterations it runs again, and the reader forgets what it kept of them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from commands.status.network import NetworkTally
from commands.train.reference import mean_loss
from bamboo.control.cluster import Cluster, in_force
from bamboo.control.config import JobConfig
from bamboo.control.protocol import (ALIVE, ASSIGNMENT, CONFIG, DONE, DRAIN, FAILED, LEFT, LOSS, MEMBERS, MODE,
                                     NOTICES, PREEMPTED, REGROUP, VAL_LOSS, ZONES, scan)


CHUNK = 100  # iterations a transaction reads at most (its reply stays far below gRPC's 4 MB)
MODE_LAG = 10  # an agent writes MODE(it) after it is complete: looked for this many iterations back


class UnknownJob(LookupError):
    """The etcd answers but holds no job of that name (the message names the ones it holds)."""


@dataclass(frozen=True)
class Finished:
    """One complete iteration, as the dashboard keeps it."""
    iteration: int
    end: float                    # wall clock of its last report
    epoch: int                    # the epoch it ran under
    loss: float | None            # the mean of the global microbatches' losses (None: some never arrived)
    val_loss: float | None        # after its step, when it was evaluated and every validation loss came
    events: tuple = ()            # the workers' failover events, as their reports carried them
    live: int = 0                 # nodes with a stage that lived through it
    checkpointed: bool = False    # a checkpoint was taken at the boundary before it: its writes fall in its time


@dataclass
class Look:
    """Everything one look at etcd gives, in one view."""
    job: str
    cfg: JobConfig
    at: float                                       # when it was read (wall clock)
    assignments: dict = field(default_factory=dict)  # epoch -> Assignment
    failed: dict = field(default_factory=dict)       # node -> Failure
    zones: dict = field(default_factory=dict)        # node -> Zone
    drains: dict = field(default_factory=dict)       # node -> Timestamp
    notices: dict = field(default_factory=dict)      # node -> Notice
    preempted: dict = field(default_factory=dict)    # node -> Preempted (injected with --preempt)
    alive: set = field(default_factory=set)          # nodes whose worker holds a lease now
    members: dict = field(default_factory=dict)      # node -> Member (its agent runs)
    modes: dict = field(default_factory=dict)        # iteration -> ModeChoice: auto's changes, and the newest
    done: list = field(default_factory=list)         # Finished, in iteration order
    left: dict = field(default_factory=dict)         # node -> Timestamp: its agent stopped
    network: dict = field(default_factory=dict)      # bytes sent by kind, and those that crossed a zone (network.py)


def open_job(endpoint: str, job: str | None, patience: float = 2.0) -> "JobView":
    """The view of `job` (None: of the only job in the etcd). EtcdError when etcd
    does not answer; UnknownJob when it holds no such job."""
    cluster = Cluster(endpoint, job or "", patience=patience, read_only=True)
    try:
        cfg = cluster.get(CONFIG()) if job is not None else None
        if cfg is None:
            names = sorted({name for name, _, _ in cluster.call(lambda: scan(cluster.client))})
            if job is None and len(names) == 1:
                cluster.close()
                return open_job(endpoint, names[0], patience)
            listed = f" ({', '.join(names)})" if names else ""
            raise UnknownJob(f"no job {job!r} in etcd {endpoint}{listed}" if job is not None else
                             f"{len(names)} jobs in etcd {endpoint}: name one with --job{listed}")
    except BaseException:
        cluster.close()
        raise
    return JobView(cluster, job, cfg)


class JobView:
    """Looks at one job; `look()` is safe from several threads (one reads at a
    time, and a look younger than `fresh` seconds is handed out again)."""

    def __init__(self, cluster: Cluster, job: str, cfg: JobConfig, fresh: float = 0.5):
        self.cluster, self.job, self.cfg, self.fresh = cluster, job, cfg, fresh
        self.kept: list[Finished] = []   # complete iterations, in order
        self.modes: dict = {}            # iteration -> ModeChoice, of the changes and the newest
        self.redone = 0                  # the newest redo epoch already accounted for
        self.network = NetworkTally()    # the workers' byte counters over the iterations kept
        self._lock = threading.Lock()
        self._last: Look | None = None

    @property
    def next(self) -> int:
        """The first iteration not known to be complete."""
        return self.kept[-1].iteration + 1 if self.kept else 0

    def look(self) -> Look:
        with self._lock:
            if self._last is None or time.time() - self._last.at >= self.fresh:
                self._last = self._read()
            return self._last

    def _read(self) -> Look:
        """Pieces of CHUNK iterations until one is not complete (a long job's first
        look takes many), each with the small families in its transaction."""
        while True:
            first = self.next
            small, tail = self._spans(first, ASSIGNMENT(), FAILED(), ZONES(), DRAIN(), NOTICES(), PREEMPTED(),
                                      ALIVE(), MEMBERS(), LEFT())
            if self._rewound(small[0]):
                continue  # the kept tail was forgotten: read it again as it stands now
            self._keep(small[0], small[1], small[2], tail)
            if self.next < first + CHUNK:
                break
        assignments, failed, zones, drains, notices, preempted, alive, members, left = small
        return Look(self.job, self.cfg, time.time(), assignments, failed, zones, drains, notices, preempted,
                    set(alive), members, dict(self.modes), list(self.kept), left, self.network.snapshot())

    def _spans(self, first: int, *whole) -> tuple[list[dict], tuple[dict, dict, dict, dict]]:
        """Every family of `whole`, and the iterations first .. first + CHUNK - 1 of
        reports, losses, validation losses and boundary agreements (from the one
        before: it says whether a checkpoint precedes `first`), in one transaction
        (the modes are kept)."""
        end = first + CHUNK
        read = self.cluster.read_spans(*[(family, None) for family in whole], (DONE(first), DONE(end)),
                                       (LOSS(first), LOSS(end)), (VAL_LOSS(first), VAL_LOSS(end)),
                                       (REGROUP(max(0, first - 1)), REGROUP(end)),
                                       (MODE(max(0, first - MODE_LAG)), MODE(end)))
        self.modes = _mode_changes({**self.modes, **read[-1]})
        return read[:len(whole)], tuple(_by_iteration(r) for r in read[len(whole):-1])

    def _rewound(self, assignments: dict) -> bool:
        """A redo epoch not seen before: forget the iterations it runs again."""
        redos = [a for a in assignments.values() if a.redo and a.epoch > self.redone]
        if not redos:
            return False
        newest = max(redos, key=lambda a: a.epoch)
        self.redone = newest.epoch
        if newest.start >= self.next:
            return False
        self.kept = [f for f in self.kept if f.iteration < newest.start]
        self.modes = {it: m for it, m in self.modes.items() if it < newest.start}
        return True

    def _keep(self, assignments: dict, failed: dict, zones: dict, tail: tuple[dict, dict, dict, dict]) -> None:
        """Keep each iteration from `next` on whose every member reported or died,
        and count the bytes its reports say were sent."""
        cfg, (done, losses, val_losses, regroups) = self.cfg, tail
        it = self.next
        while it in done and assignments and any(a.start <= it for a in assignments.values()):
            epoch = in_force(assignments, it)
            reports = done[it]
            if not all(n in reports or n in failed for n in epoch.members):
                return
            loss = losses.get(it, {})
            mean = mean_loss({g: loss[g].value for g in loss}, cfg.schedule.microbatches) \
                if sorted(loss) == list(range(cfg.schedule.microbatches)) else None
            val = val_losses.get(it, {})
            validated = mean_loss({g: val[g].value for g in val}, cfg.data.eval_batches) \
                if cfg.evaluates(it) and sorted(val) == list(range(cfg.data.eval_batches)) else None
            live = sum(n not in failed or failed[n].iteration > it for n in epoch.members)
            events = tuple(e for r in reports.values() for e in r.events)
            for n, r in reports.items():
                self.network.add(epoch.pipelines, n, r.sent_bytes, zones)
            self.kept.append(Finished(it, max(r.time for r in reports.values()), epoch.epoch, mean, validated,
                                      events, live, _checkpoint_before(regroups.get(it - 1, {}))))
            it += 1

    def close(self) -> None:
        self.cluster.close()


def _mode_changes(modes: dict) -> dict:
    """Of --redundancy auto's choices, those that wanted a mode other than the one
    before (what made the agents switch), and the newest (what they weigh now)."""
    kept, before = {}, None
    for it in sorted(modes):
        if modes[it].mode != before:
            kept[it] = modes[it]
        before = modes[it].mode
    if modes:
        kept[max(modes)] = modes[max(modes)]
    return kept


def _checkpoint_before(tries: dict) -> bool:
    """Whether the boundary agreed (its last try: try -> Regroup) on a checkpoint."""
    return bool(tries) and tries[max(tries)].checkpoint is True


def _by_iteration(records: dict) -> dict:
    """{(it, x): record} as {it: {x: record}}."""
    out: dict = {}
    for (it, x), record in records.items():
        out.setdefault(it, {})[x] = record
    return out
