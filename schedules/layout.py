"""Who owns which stage, and who holds which replica, once some nodes have failed.

Node m owns stage m and holds the layers of stage (m+1) mod P. When node d fails,
its predecessor (which already holds stage d) takes the stage over. So every stage
lives on its original node or on that node's predecessor, and two failed nodes
that are neighbours (cyclically: node P-1 holds stage 0) lose a stage for good.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduleError(ValueError):
    """Invalid schedule arguments, or a failure the pipeline cannot survive."""


class Group(NamedTuple):
    """A virtual stage: consecutive pipeline stages run back to back by one node."""
    node: int
    stages: tuple[int, ...]


MICROBATCHES_MAX = 100_000  # per iteration: every node's stream is a few instructions per microbatch


def check_microbatches(microbatches: int) -> None:
    if microbatches < 1:
        raise ScheduleError(f"--microbatches must be at least 1 (got {microbatches})")
    if microbatches > MICROBATCHES_MAX:
        raise ScheduleError(f"--microbatches must be at most {MICROBATCHES_MAX} (got {microbatches})")


@dataclass(frozen=True)
class Layout:
    stages: int
    failed: frozenset[int] = field(default_factory=frozenset)
    replicas: bool = True  # False without redundancy: nobody holds a neighbour's layers

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed", frozenset(self.failed))
        if self.stages < 2:
            raise ScheduleError(f"--stages must be at least 2 (got {self.stages})")
        for n in sorted(self.failed):
            if not 0 <= n < self.stages:
                raise ScheduleError(f"failed node {n} is out of range 0..{self.stages - 1}")
        if lost := Layout.lost(self.stages, self.failed):
            n = min((s - 1) % self.stages for s in lost)
            nxt = (n + 1) % self.stages
            raise ScheduleError(
                f"failed nodes {n} and {nxt} are adjacent: stage {nxt} has no copy left "
                "in this pipeline (recover it from another pipeline or a checkpoint)")

    @staticmethod
    def lost(stages: int, failed, replicas: bool = True) -> frozenset[int]:
        """Stages left with no live copy in a pipeline whose nodes `failed` died: with
        replicas, those whose owner and predecessor both died; without, every failed
        node's. (A Layout refuses such a failed set; this says which stages went.)"""
        dead = {int(n) for n in failed}
        return frozenset(s for s in dead if not replicas or (s - 1) % stages in dead)

    @property
    def alive(self) -> tuple[int, ...]:
        return tuple(n for n in range(self.stages) if n not in self.failed)

    def owner(self, stage: int) -> int:
        return stage if stage not in self.failed else (stage - 1) % self.stages

    def owned(self, node: int) -> tuple[int, ...]:
        """Stages a live node computes, in increasing stage order."""
        return tuple(s for s in range(self.stages) if self.owner(s) == node)

    def held(self, node: int) -> tuple[int, ...]:
        """Stages whose layers a live node keeps up to date: its own and, with
        replicas, its successor's (a replica while the successor lives, owned once
        the node took it over)."""
        return tuple(sorted({node, (node + 1) % self.stages} if self.replicas else {node}))

    def replica(self, node: int) -> int | None:
        """The stage whose replica `node` keeps warm with FRC, if its owner is alive."""
        nxt = (node + 1) % self.stages
        return nxt if self.replicas and nxt not in self.failed and node not in self.failed else None

    def holder(self, stage: int) -> int | None:
        """The node keeping a replica of `stage`, if any."""
        prev = (stage - 1) % self.stages
        return prev if self.replica(prev) == stage else None

    def groups(self) -> list[Group]:
        out: list[Group] = []
        for s in range(self.stages):
            node = self.owner(s)
            if out and out[-1].node == node:
                out[-1] = Group(node, out[-1].stages + (s,))
            else:
                out.append(Group(node, (s,)))
        return out

    def with_failed(self, node: int) -> "Layout":
        return Layout(self.stages, self.failed | {node}, self.replicas)
