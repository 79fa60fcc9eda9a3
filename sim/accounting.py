"""What one simulated run has earned and spent so far, and the summary it ends with.

Kept apart from the simulator's event loop and from the strategies so that both
change the same ledger in the same few ways (pause, checkpoint, rewind) and every
strategy reports in the same shape.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from schedules.deaths import PATHS


@dataclass
class RunState:
    t: float = 0.0
    samples: float = 0.0
    saved: float = 0.0          # samples in the last complete checkpoint
    pending: tuple[float, float] | None = None  # (samples, write ends): a checkpoint being written
    next_checkpoint: float = math.inf
    period_start: float = 0.0   # when training since the last checkpoint (or restart) began
    checkpoints: int = 0
    interval_sum: float = 0.0   # intervals scheduled, summed (their mean is reported)
    intervals: int = 0
    paused_until: float = 0.0
    node_seconds: float = 0.0
    fatal: int = 0
    redos: int = 0              # iterations abandoned and redone from another pipeline's copies
    iteration_start: float = 0.0  # samples when the iteration under way began
    lost_partial: float = 0.0   # samples of abandoned partial iterations
    preemptions: int = 0
    idle_seconds: float = 0.0   # node-seconds paid for by nodes in no pipeline (those justified: booked["standby"])
    bursts: list = field(default_factory=list)  # nodes each batch of losses took from the job, so far
    rewound: float = 0.0        # samples a fatal failure sent back (trained, then lost)
    pauses: list = field(default_factory=list)  # (start, end, reason) of each pause, in order, not overlapping
    booked: dict = field(default_factory=lambda: defaultdict(float))  # paid node-seconds by what they went to (book())
    drained: int = 0            # announced preemptions acted on before they came
    skipped_checkpoints: int = 0  # fell due while no pipeline could train: nothing to write
    survived: dict = field(default_factory=lambda: dict.fromkeys(PATHS, 0))  # deaths of nodes in use, by path
    storage_reloads: float = 0.0  # node-seconds rollbacks read storage beyond what a copy in memory takes
    timeline: list = field(default_factory=list)  # (time, nodes, samples/s)

    def pause(self, seconds: float, reason: str = "pause") -> None:
        """Stop training for `seconds` more, from now or from the end of a pause under
        way; `reason` names that time in the ledger."""
        start = max(self.paused_until, self.t)
        seconds = max(0.0, seconds)  # a pause never gives back time that trained
        self.paused_until = start + seconds
        if seconds > 0:
            self.pauses.append((start, self.paused_until, reason))

    def skip_checkpoint(self) -> None:
        """A checkpoint fell due while no pipeline could train: nothing to write. Count
        it; the next is scheduled when training resumes."""
        self.skipped_checkpoints += 1
        self.next_checkpoint = math.inf

    def survive(self, path: str, deaths: int) -> None:
        """Count `deaths` of nodes in use as survived by `path` (schedules/deaths.py's)."""
        self.survived[path] += deaths

    def resumes(self) -> float:
        """When training goes on again."""
        return max(self.t, self.paused_until)

    def checkpoint(self, done_at: float | None = None) -> None:
        """Save the samples so far; the checkpoint counts once its write ends at `done_at`."""
        self._settle()
        self.pending = (self.samples, self.t if done_at is None else done_at)
        self._settle()

    def _settle(self) -> None:
        if self.pending and self.pending[1] <= self.t:
            self.saved, self.pending = self.pending[0], None

    def save_now(self) -> None:
        """A checkpoint written in a preemption's notice, complete before it comes."""
        self.pending = None
        self.saved = self.samples

    def rewind(self) -> None:
        """A fatal failure: the work since the last complete checkpoint is gone."""
        self._settle()
        self.pending = None
        self.fatal += 1
        self.rewound += self.samples - self.saved
        self.samples = self.iteration_start = self.saved

    def partial(self, per_iteration: float) -> float:
        """Samples of the iteration under way trained so far."""
        return (self.samples - self.iteration_start) % per_iteration

    def phase(self, per_iteration: float) -> float:
        """How far the iteration under way has come, as a share of it."""
        return self.partial(per_iteration) / per_iteration

    def abandon_iteration(self, per_iteration: float) -> None:
        """The iteration under way is dropped: back to its first sample."""
        partial = self.partial(per_iteration)
        self.samples -= partial
        self.lost_partial += partial
        self.iteration_start = self.samples


def book(s: RunState, span: tuple[float, float], nodes: tuple[int, int, int], standby: float,
         redundant: float, waiting: bool = False) -> None:
    """Book `span` (from, to) of the paid `nodes` (held, of them in pipelines, and
    arriving): the held ones in no pipeline as standby (`standby` node-seconds of
    them), the rest of them as acquisition waits while they `wait` for the nodes
    asked for, else as idle; those asked for and not yet here as acquisition waits;
    those in pipelines by the pauses overlapping it, and the rest as training, of
    which the share `redundant` is redundancy: what FRC and replica syncs add to an
    iteration without them."""
    start, end = span
    if end <= start:
        return
    booked = s.booked
    held, used, arriving = nodes
    idle = held - used
    standby = min(standby, idle * (end - start))
    booked["standby"] += standby
    booked["acquisition waits" if waiting else "idle"] += idle * (end - start) - standby
    booked["acquisition waits"] += arriving * (end - start)
    paused = 0.0
    for first, last, reason in s.pauses:
        overlap = min(end, last) - max(start, first)
        if overlap > 0:
            booked[reason] += used * overlap
            paused += overlap
    booked["redundancy"] += used * (end - start - paused) * redundant
    booked["training"] += used * (end - start - paused) * (1 - redundant)
    s.pauses = [p for p in s.pauses if p[1] > end]  # the rest is behind us


def ledger(s: RunState) -> dict[str, float]:
    """Paid node-hours by what they went to; they sum to the node-hours paid. The
    samples later lost (an abandoned iteration, a rewind) take their share of the
    training time as `redone work`, at the run's training time per sample."""
    out = dict(s.booked)
    lost = s.lost_partial + s.rewound
    trained = s.samples + lost
    if trained > 0 and out.get("training"):
        out["redone work"] = out["training"] * lost / trained
        out["training"] -= out["redone work"]
    return {k: round(v / 3600, 4) for k, v in sorted(out.items()) if v}


def summary(strategy, preemptions, fatal, mean_nodes, samples, horizon, cost_per_hour, timeline) -> dict:
    """The result of a run over `horizon` seconds; value is samples per second per
    dollar per hour."""
    throughput = samples / horizon if horizon else 0.0
    hours = horizon / 3600 if horizon else 0.0
    return {"strategy": strategy, "hours": round(hours, 3), "preemptions": preemptions, "fatal_failures": fatal,
            "mean_nodes": round(mean_nodes, 3), "throughput": round(throughput, 4),
            "cost_per_hour": round(cost_per_hour, 3),
            "value": round(throughput / cost_per_hour, 5) if cost_per_hour else 0.0,
            "samples": round(samples), "timeline": [(round(t, 1), n, round(r, 4)) for t, n, r in timeline]}
