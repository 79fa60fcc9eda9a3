"""Which node runs which stage, from which iteration on: the workers' view of a
configuration epoch (the agents' policy writes it; `bamboo` only reads it).

A node's id is a job-wide integer that is never reused. Within a pipeline a node
is known by the stage it starts the epoch on (its "local id"): after a failover
the compiler's layouts speak of local ids, and an Assignment translates.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedules.layout import Layout, keeps_replicas


@dataclass(frozen=True)
class Assignment:
    epoch: int
    start: int                                  # first iteration this epoch runs
    pipelines: tuple[tuple[int, ...], ...]      # pipelines[j][s]: the node that starts on stage s
    standby: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()                # the failures the previous epoch's nodes hold layers after
    gone: tuple[int, ...] = ()                  # dead by now: they send nothing (after an abort, more than failed)
    restore: str = "peers"                      # where layers come from: "peers", "checkpoint" or "initial"
    redo: bool = False                          # the epoch starts by running again an abandoned iteration
    layers_from: int = -1                       # the epoch whose layout the nodes' layers follow (-1: none yet)
    redundancy: str = ""                        # the epoch's mode (eager, lazy, off); "": the job's --redundancy

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
        return tuple(sorted(n for pipe in self.pipelines for n in pipe))

    def slot(self, node: int) -> tuple[int, int]:
        """(pipeline, stage) of `node`; KeyError if it runs none."""
        for j, pipe in enumerate(self.pipelines):
            if node in pipe:
                return j, pipe.index(node)
        raise KeyError(f"node {node} has no stage in epoch {self.epoch}")

    def local_failed(self, pipeline: int, failed) -> tuple[int, ...]:
        """Local ids of the nodes of `pipeline` among the node ids `failed`."""
        dead = {int(n) for n in failed}
        return tuple(s for s, n in enumerate(self.pipelines[pipeline]) if n in dead)

    def holders(self, failed, redundancy: str = "eager") -> dict[int, set[int]]:
        """node -> the stages it holds up to date, for the live nodes. With
        redundancy node s holds stage s and stage s + 1 whatever failed: the replica
        is synced while its owner lives and owned once the node took it over."""
        dead = {int(n) for n in failed}
        out: dict[int, set[int]] = {}
        for pipe in self.pipelines:
            layout = Layout(len(pipe), replicas=keeps_replicas(redundancy))
            for s, n in enumerate(pipe):
                if n not in dead:
                    out[n] = set(layout.held(s))
        return out

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "pipelines": [list(p) for p in self.pipelines],
                "standby": list(self.standby), "failed": list(self.failed), "gone": list(self.gone),
                "restore": self.restore, "redo": self.redo, "layers_from": self.layers_from,
                "redundancy": self.redundancy}

    @classmethod
    def from_dict(cls, d: dict) -> "Assignment":
        return cls(int(d["epoch"]), int(d["start"]), tuple(tuple(int(n) for n in p) for p in d["pipelines"]),
                   tuple(int(n) for n in d.get("standby", ())), tuple(int(n) for n in d.get("failed", ())),
                   tuple(int(n) for n in d.get("gone", ())), d.get("restore", "peers"), bool(d.get("redo")),
                   int(d.get("layers_from", -1)), d.get("redundancy", ""))
