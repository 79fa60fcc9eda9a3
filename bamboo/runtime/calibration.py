"""FRC placed by measured per-op times: the cost model eager's placement
uses, from what this job's own instructions took.

The compiler fits a redundant forward into a wait only where the cost model says
it fits whole. Its default model (forward 1, backward 2, messages and swaps nearly
free) is not this machine: a stage with the head forwards slower than the others,
and a swap costs a quarter of a forward on the CPU. An FRC placed by it can
overrun its wait and delay the pipeline. So, after the first iterations of each
epoch (CALIBRATION: the first is left out, for its warm-up), every node reports
the median time of each op it ran in them (CPU only: CUDA kernels run after
their launch returns), the boundary's first proposer turns
the reports into one cost model per pipeline, and every node of the pipeline
places FRC with that model from the next iteration on. It is decided once, in the
boundary's single record, so the nodes of a pipeline (whose recoveries assume the
same streams) always place alike. Redundant forwards are costed FRC_MARGIN times
what they measured, so that one fits its wait with room for this machine's noise.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from schedules.compiler import compile_schedule
from schedules.cost import CostModel
from schedules.ir import Instr, Op
from schedules.options import ScheduleOptions

CALIBRATION = range(1, 4)  # the iterations of an epoch (0: its first) whose op times are reported
FRC_MARGIN = 1.25   # an FRC must fit its wait as if it took this much longer
TIMED = frozenset({Op.LOAD, Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.SWAP_OUT,
                   Op.SEND_ACT, Op.SEND_GRAD, Op.OPTIMIZER_STEP, Op.REDUCE_GRADS})


def op_key(ins: Instr) -> str | None:
    """The name a timed op's duration is reported under (None: not timed)."""
    if ins.op not in TIMED:
        return None
    if ins.op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
        return f"{ins.op.value}{'_r' if ins.redundant else ''}/{ins.stage}"
    if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
        return "send"
    return "step" if ins.op is Op.OPTIMIZER_STEP and not ins.redundant else ins.op.value


class OpTimes:
    """Durations of timed ops over an epoch's calibration iterations, by op_key."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def add(self, ins: Instr, seconds: float) -> None:
        key = op_key(ins)
        if key is not None:
            self.seconds[key].append(seconds)

    def medians_ms(self) -> dict[str, float]:
        return {k: round(statistics.median(v) * 1e3, 4) for k, v in sorted(self.seconds.items())}


def propose(reports: dict, pipelines: tuple[tuple[int, ...], ...]) -> dict | None:
    """Each pipeline's cost model (as CostModel keywords, by pipeline index) from the
    nodes' reported medians; None unless every node of every pipeline reported and
    none took part in a failover (a merged stream times another mix of work)."""
    if any(r.events or not r.op_ms for r in reports.values()):
        return None
    out = {}
    for j, nodes in enumerate(pipelines):
        if any(n not in reports for n in nodes):
            return None
        model = _pipeline_cost([reports[n].op_ms for n in nodes])
        if model is None:
            return None
        out[str(j)] = model
    return out


def _pipeline_cost(times: list[dict[str, float]]) -> dict | None:
    """CostModel keywords for a pipeline whose node s reported `times[s]`. Sends are
    posted, so a message costs its sender the post, and flies about as long."""
    forward = [t.get(f"forward/{s}") for s, t in enumerate(times)]
    passes = [split_passes(t, s) for s, t in enumerate(times)]  # split backwards' (input, weight) times
    backward = [t.get(f"backward/{s}", sum(p) if p else None) for (s, t), p in zip(enumerate(times), passes)]
    split = [p for p in passes if p]
    if None in forward or None in backward:
        return None

    def median_of(key: str, default: float) -> float:
        found = [t[key] for t in times if key in t]
        return statistics.median(found) if found else default

    # the replica's forward is the next stage's layers: how much slower it ran (swapped saves)
    ratios = [t[f"forward_r/{(s + 1) % len(times)}"] / forward[(s + 1) % len(times)]
              for s, t in enumerate(times) if f"forward_r/{(s + 1) % len(times)}" in t]
    send = median_of("send", 0.0)
    return {"forward": forward, "backward": backward, "transfer": send, "send": send,
            "swap": median_of("swap_out", 0.25 * min(forward)), "load": median_of("load", 0.0),
            "reduce": median_of("reduce_grads", 0.0), "step": median_of("step", 0.0), "sync_transfer": send,
            "frc_factor": FRC_MARGIN * max(1.0, statistics.median(ratios) if ratios else 1.0),
            "input_share": statistics.median(i / (i + w) for i, w in split) if split else 0.5}


def split_passes(t: dict[str, float], stage: int) -> tuple[float, float] | None:
    """A split backward's input and weight pass times on `stage` (None unless both were timed)."""
    both = t.get(f"backward_input/{stage}"), t.get(f"backward_weight/{stage}")
    return None if None in both else both


def cost_model(costs: dict | None, pipeline: int, stages: int) -> CostModel | None:
    """The agreed cost model of `pipeline` (None: none agreed, or not for this depth)."""
    found = (costs or {}).get(str(pipeline))
    if found is None or len(found["forward"]) != stages:
        return None
    return CostModel(**found)


def describe(cost: CostModel, microbatches: int, failed: tuple[int, ...], options: ScheduleOptions, me: int) -> str:
    """A log line: what the measured model places on node `me` of its pipeline (eager)."""
    placed = compile_schedule(len(cost.forward), microbatches, failed, options, cost)
    return (f"FRC is placed by measured op times: microbatches {placed.frc_microbatches(me)} "
            f"(forward ms {[round(f, 2) for f in cost.forward]}, FRC costed x{cost.frc_factor:.2f})")
