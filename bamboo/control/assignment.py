"""Which node runs which stage, from which iteration on: the workers' view of a
configuration epoch (the agents' policy writes it; `bamboo` only reads it).

A node's id is a job-wide integer that is never reused. Within a pipeline a node
is known by the stage it starts the epoch on (its "local id"): after a failover
the compiler's layouts speak of local ids, and an Assignment translates.

A pipeline shorter than the depth (agents/policy.py, --max-stages-per-node 2)
names a node at each stage of the contiguous range it runs: its first stage is
its local id, and each further one (`schedules.split.merged`) counts as a local
id that failed and was merged into it, for every epoch and iteration alike. So
the compiler, the failover and the reduce run it as they run a pipeline after a
failover, and a death of a node on two stages is two adjacent failures: its
pipeline cannot finish the iteration, which is redone from the other pipelines.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from schedules.layout import Layout
from schedules.options import SYNC_CHOICES, keeps_replicas
from schedules.split import merged, split_by_speed


WHY_CHARS = 400  # a redo's reason is kept to this many characters


class Restore(str, Enum):
    """Where an epoch's layers come from."""
    PEERS = "peers"            # the live nodes' layers and replicas, moved in a handover
    MEMORY = "memory"          # the checkpoint copies the live nodes keep (bamboo/state/copies.py)
    CHECKPOINT = "checkpoint"  # the checkpoint in storage
    INITIAL = "initial"        # built again from the seed: the job's first iteration

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Assignment:
    epoch: int
    start: int                                  # first iteration this epoch runs
    pipelines: tuple[tuple[int, ...], ...]      # pipelines[j][s]: the node that starts on stage s
    standby: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()                # the failures the previous epoch's nodes hold layers after
    gone: tuple[int, ...] = ()                  # dead by now: they send nothing (after an abort, more than failed)
    restore: Restore = Restore.PEERS            # where layers come from
    redo: bool = False                          # the epoch starts by running again an abandoned iteration
    layers_from: int = -1                       # the epoch whose layout the nodes' layers follow (-1: none yet)
    redundancy: str = ""                        # the epoch's mode (eager, lazy, off); "": the job's --redundancy
    sync: str = ""                              # the epoch's replica sync (end, next); "": the job's --replica-sync
    taken: tuple[int, ...] | None = None        # of `failed`, those a survivor took over inside an iteration that
                                                # completed (--replica-sync next: see `holders`); None: every
                                                # replica is up to date (an epoch's first iteration owed no sync)
    why: str = ""                               # a redo's cause: the reason the node that gave the iteration up wrote

    def __post_init__(self):
        object.__setattr__(self, "restore", Restore(self.restore))  # given as text: checked here

    @classmethod
    def static(cls, stages: int, pipelines: int, start: int = 0) -> "Assignment":
        """Node j * P + s on stage s of pipeline j: the layout without agents."""
        return cls(0, start, tuple(tuple(range(j * stages, (j + 1) * stages)) for j in range(pipelines)))

    def mode(self, default: str) -> str:
        """The redundancy mode this epoch runs (with --redundancy auto, the agents'
        choice; else the job's, `default`)."""
        return self.redundancy or default

    @property
    def depth(self) -> int:
        return len(self.pipelines[0]) if self.pipelines else 0

    @property
    def members(self) -> tuple[int, ...]:
        """Every node with a stage, once (a node on two stages of a short pipeline too)."""
        return tuple(sorted({n for pipe in self.pipelines for n in pipe}))

    def slot(self, node: int) -> tuple[int, int]:
        """(pipeline, first stage) of `node`: its local id; KeyError if it runs none."""
        for j, pipe in enumerate(self.pipelines):
            if node in pipe:
                return j, pipe.index(node)
        raise KeyError(f"node {node} has no stage in epoch {self.epoch}")

    def merged(self, pipeline: int) -> frozenset[int]:
        """Local ids that are a node's second stage in `pipeline` (a short one): they
        count as failed and merged into their predecessor for the whole epoch."""
        return merged(self.pipelines[pipeline])

    def local_failed(self, pipeline: int, failed) -> tuple[int, ...]:
        """Local ids of the nodes of `pipeline` among the node ids `failed`, and the
        stages run merged into a predecessor on a short pipeline."""
        dead = {int(n) for n in failed}
        pipe = self.pipelines[pipeline]
        return tuple(sorted({s for s, n in enumerate(pipe) if n in dead} | self.merged(pipeline)))

    def microbatches(self, total: int, pipeline: int) -> range:
        """The global microbatch ids of `total` that `pipeline` runs: in proportion to
        the pipelines' speed (schedules/split.py; an even split for equal ones).
        Fewer than the pipelines (an evaluation's few batches): the first ones one each."""
        if total < len(self.pipelines):
            return range(pipeline, pipeline + 1) if pipeline < total else range(total, total)
        return split_by_speed(total, self.pipelines)[pipeline]

    def stages_of(self, node: int, redundancy: str = "eager") -> tuple[int, ...]:
        """The stages `node` holds up to date: those it runs and, with redundancy,
        the successor's first stage when the node runs one stage only (a node on two
        stages of a short pipeline keeps no replica: its memory is its two stages)."""
        j, first = self.slot(node)
        pipe = self.pipelines[j]
        layout = Layout(len(pipe), self.merged(j), keeps_replicas(redundancy))
        return tuple(sorted(set(layout.owned(first)) | set(layout.held(first))))

    def holders(self, failed, redundancy: str = "eager", taken=None) -> dict[int, set[int]]:
        """node -> the stages it holds up to date, for the live nodes. With
        redundancy node s holds stage s and stage s + 1 whatever failed: the replica
        is synced while its owner lives and owned once the node took it over.
        `taken` (--replica-sync next): a replica is a step behind its owner at a
        boundary (the last sync is owed), so a node holds up to date only the
        stages it runs, and those of the dead in `taken` it took over."""
        dead = {int(n) for n in failed}
        return {n: self.current(n, redundancy, taken) for n in self.members if n not in dead}

    def current(self, node: int, redundancy: str = "eager", taken=None) -> set[int]:
        """The stages `node` holds up to date (see `holders`; None: every replica synced)."""
        if taken is None:
            return set(self.stages_of(node, redundancy))
        j, first = self.slot(node)
        pipe = self.pipelines[j]
        took = {s for s, n in enumerate(pipe) if n in {int(t) for t in taken}}
        layout = Layout(len(pipe), self.merged(j) | took, keeps_replicas(redundancy))
        return set(layout.owned(first))

    def lost(self, pipeline: int, failed, redundancy: str = "eager", taken=None) -> frozenset[int]:
        """Stages no live node of `pipeline` holds once the nodes `failed` died."""
        dead = {int(n) for n in failed}
        held = {s for n in set(self.pipelines[pipeline]) - dead for s in self.current(n, redundancy, taken)}
        return frozenset(range(self.depth)) - held

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "pipelines": [list(p) for p in self.pipelines],
                "standby": list(self.standby), "failed": list(self.failed), "gone": list(self.gone),
                "restore": self.restore.value, "redo": self.redo, "layers_from": self.layers_from,
                "redundancy": self.redundancy, "sync": self.sync,
                "taken": None if self.taken is None else list(self.taken), "why": self.why}

    @classmethod
    def from_dict(cls, d: dict) -> "Assignment":
        for name in ("restore", "redundancy", "sync", "why"):  # shown and compared as text
            if not isinstance(d.get(name, ""), str):
                raise ValueError(f"an assignment's {name} is {type(d[name]).__name__}, not a string")
        if d.get("sync", "") not in ("", *SYNC_CHOICES):
            raise ValueError(f"an assignment's sync is {d['sync'][:20]!r}, not one of {', '.join(SYNC_CHOICES)}")
        return cls(int(d["epoch"]), int(d["start"]), tuple(tuple(int(n) for n in p) for p in d["pipelines"]),
                   tuple(int(n) for n in d.get("standby", ())), tuple(int(n) for n in d.get("failed", ())),
                   tuple(int(n) for n in d.get("gone", ())), Restore(d.get("restore", "peers")), bool(d.get("redo")),
                   int(d.get("layers_from", -1)), d.get("redundancy", ""), d.get("sync", ""),
                   None if d.get("taken") is None else tuple(int(n) for n in d["taken"]), d.get("why", "")[:WHY_CHARS])
