"""What a checkpoint and a restart cost, and how often to take one.

Kept apart from the strategies because every spot strategy checkpoints (Bamboo
and redo-from-peers fall back to a checkpoint when no copy of a stage is left),
and all of them should pay the same for it.

A checkpoint stalls training while each stage's state is first copied off the
accelerator (the snapshot, over PCIe) and then written to storage (its bytes over
the stated per-node storage bandwidth; the stages are written in parallel, one
writer per stage). A restart relaunches the processes, loads the state back from
storage at the same bandwidth, and warms up. Replacement nodes are not waited
for: the trace says when nodes arrive, and the job restarts on those it has.

The interval: Young's first-order optimum sqrt(2 C M) or Daly's higher-order one,
for a checkpoint cost C and the job's mean time between failures M (the node MTBF
the trace shows, over the nodes the job uses). Both give the compute time between
the end of one write and the start of the next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sim.options import Options
from sim.profiles import Profile

FORMULAS = ("daly", "young")


@dataclass(frozen=True)
class CheckpointCosts:
    state_bytes: float          # one stage's weights and optimizer state: what each writer moves
    snapshot_bandwidth: float   # bytes/s, accelerator -> host
    storage_bandwidth: float    # bytes/s per node, host <-> storage
    relaunch_seconds: float     # stop, relaunch the processes, rendezvous
    warmup_seconds: float       # first iterations slower (allocator, kernels, data loader)
    free_writes: bool = False   # the old baseline: checkpoints cost nothing
    restart_override: float | None = None  # a fixed restart cost instead of the sum

    @property
    def snapshot_seconds(self) -> float:
        return 0.0 if self.free_writes else self.state_bytes / self.snapshot_bandwidth

    @property
    def storage_seconds(self) -> float:
        return 0.0 if self.free_writes else self.state_bytes / self.storage_bandwidth

    @property
    def write_seconds(self) -> float:
        """C: training stalls this long for each checkpoint."""
        return self.snapshot_seconds + self.storage_seconds

    @property
    def load_seconds(self) -> float:
        return self.state_bytes / self.storage_bandwidth

    @property
    def restart_seconds(self) -> float:
        if self.restart_override is not None:
            return self.restart_override
        return self.relaunch_seconds + self.load_seconds + self.warmup_seconds

    def describe(self) -> dict:
        """Every parameter and what follows from it, for the JSON output."""
        return {"state_bytes_per_node": round(self.state_bytes), "snapshot_bandwidth": self.snapshot_bandwidth,
                "storage_bandwidth": self.storage_bandwidth, "snapshot_seconds": round(self.snapshot_seconds, 3),
                "storage_seconds": round(self.storage_seconds, 3), "write_seconds": round(self.write_seconds, 3),
                "free_writes": self.free_writes, "relaunch_seconds": self.relaunch_seconds,
                "load_seconds": round(self.load_seconds, 3), "warmup_seconds": self.warmup_seconds,
                "restart_seconds": round(self.restart_seconds, 3),
                "restart_fixed": self.restart_override is not None}


def young_interval(cost: float, mtbf: float) -> float:
    """Young (1974): compute time between checkpoints, sqrt(2 C M)."""
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly (2006), the higher-order estimate: better than Young's when C is not
    small against M; M itself once C reaches 2 M."""
    if cost >= 2 * mtbf:
        return mtbf
    ratio = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


def optimal_interval(formula: str, cost: float, mtbf: float) -> float:
    """Seconds of training between checkpoints; without a cost, checkpoints are
    free and the interval is a nominal minute (never zero)."""
    if formula not in FORMULAS:
        raise ValueError(f"unknown checkpoint formula {formula!r} (choose from {', '.join(FORMULAS)})")
    if not math.isfinite(mtbf):
        return math.inf
    if cost <= 0:
        return 60.0
    return (daly_interval if formula == "daly" else young_interval)(cost, mtbf)


@dataclass(frozen=True)
class TraceStats:
    """What the trace shows about preemptions, over the simulated horizon."""
    node_hours: float
    preemptions: int

    @property
    def node_mtbf_seconds(self) -> float:
        return self.node_hours * 3600 / self.preemptions if self.preemptions else math.inf

    def describe(self) -> dict:
        mtbf = self.node_mtbf_seconds
        return {"node_hours": round(self.node_hours, 3), "preemptions": self.preemptions,
                "node_mtbf_hours": round(mtbf / 3600, 4) if math.isfinite(mtbf) else None}


def trace_stats(events, horizon: float) -> TraceStats:
    """Node-hours held and removals within [0, horizon] of a time-sorted trace."""
    count, last, area, removes = 0, 0.0, 0.0, 0
    for e in events:
        if e.time > horizon:
            break
        area += count * (e.time - last)
        last = e.time
        count += 1 if e.action == "add" else -1
        removes += e.action == "remove"
    area += count * max(0.0, horizon - last)
    return TraceStats(area / 3600, removes)


def checkpoint_costs(profile, depth: int, opt: Options) -> CheckpointCosts:
    """One stage's checkpoint bytes from the profile's parameter count (a measured
    profile has none: its checkpoints are free)."""
    params = profile.stage_params(depth) if isinstance(profile, Profile) else 0.0
    return CheckpointCosts(state_bytes=params * opt.checkpoint_bytes_per_param,
                           snapshot_bandwidth=opt.snapshot_bandwidth, storage_bandwidth=opt.storage_bandwidth,
                           relaunch_seconds=opt.relaunch_seconds, warmup_seconds=opt.warmup_seconds,
                           free_writes=opt.free_checkpoints or params == 0, restart_override=opt.restart_seconds)


def checkpoint_report(opt, costs: CheckpointCosts, s) -> dict:
    """Every parameter of a run's checkpoints and restarts (`opt`: its Options), and
    what followed (`s`: its RunState)."""
    out = {"formula": "fixed" if opt.checkpoint_seconds is not None else opt.checkpoint_formula,
           "bytes_per_param": opt.checkpoint_bytes_per_param, **costs.describe()}
    if opt.checkpoint_seconds is not None:
        out["interval_seconds"] = opt.checkpoint_seconds
    out["checkpoints_taken"] = s.checkpoints
    out["checkpoints_skipped"] = s.skipped_checkpoints
    out["mean_interval_seconds"] = round(s.interval_sum / s.intervals, 2) if s.intervals else None
    return out
