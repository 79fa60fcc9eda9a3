"""What a failover knows of the iteration under way (Watch), what its polls can find
(the events the executor acts on), and the watches it wakes on: the failover's
vocabulary, apart from bamboo/runtime/failover.py's logic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from schedules.cost import CostModel
from schedules.ir import Instr

from bamboo.control.changes import Changes
from bamboo.control.protocol import Local, NodeId
from bamboo.runtime.marks import Gather
from bamboo.transport.comm import Comm


# What a poll of the failover can find; the executor decides what each means for it.
@dataclass(frozen=True)
class PeerDead:
    """A node of this pipeline is recorded dead: switch to the recovery stream."""
    local: Local


@dataclass(frozen=True)
class PeersSilent:
    """Peers whose leases ran out: the executor records them dead (a record that
    exists already stands)."""
    nodes: tuple[NodeId, ...]


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


class Completed(NamedTuple):
    """What a node whose own finished mark completed its pipeline read with the mark:
    the pipeline's marks (each with its node's report), the reports and the deaths so far."""
    marks: dict
    reports: dict
    deaths: dict


@dataclass
class Watch:
    """What the failover knows of the iteration under way: made by `begin`, once
    per iteration, so nothing of the last one lingers."""
    iteration: int
    microbatches: int
    failed: tuple[Local, ...]          # this pipeline's nodes dead before it (it runs merged)
    comm: Comm | None
    streams: dict[Local, list[Instr]]  # every node's stream, compiled once
    cost: CostModel = CostModel()      # what eager's FRC was placed with (the recovery assumes the same)
    baseline: dict = field(default_factory=dict)  # messages received before this iteration
    dead_before: frozenset = frozenset()  # the nodes recorded dead as of its start (a lender serves after more)
    dead: Local | None = None          # the death being recovered from
    seen_finished: dict | None = None  # the finished marks read with this node's own
    read_with_mark: tuple[dict, dict] | None = None  # the reports and deaths read with this node's last mark
    completed: Completed | None = None  # when this node's mark completed a pipeline that lost nobody
    gather: Gather | None = None       # the marks gathered on the data plane (None: each node writes its own)
    recovered: bool = False            # a death in the pipeline was recovered from in this iteration
    due: bool = True                   # read etcd at the next poll, whatever the watch says
    event: object = None               # what the last look found
    checked: float = 0.0               # when etcd was last read (without a watch: every 20 ms)
    leases_checked: float = 0.0        # when peers' leases were last asked
    wait_began: float = 0.0            # the current wait on peers: when it began, ...
    waited: float = 0.0                # ... and when it last asked


class Watches(NamedTuple):
    """The etcd watches a failover wakes on (without them it reads etcd every 20 ms)."""
    failures: Changes  # raised by a watch on failed/ and abort/
    finishes: Changes  # raised by a watch on failed/ and abort/ (wakes linger; marks are read every LINGER_WAKE)
