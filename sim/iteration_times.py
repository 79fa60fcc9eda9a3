"""The schedule simulator's times of a configuration's iteration, cached: what
`ClusterSimulator` asks of the compiler for every configuration a trace brings.
Kept apart from its event loop, so that one holds the run and this the schedules
it is timed by (a profile's cost model, or a measured profile's times)."""
from __future__ import annotations

import math
from functools import lru_cache

from schedules.compiler import compile_schedule
from schedules.options import Frc, ScheduleOptions
from schedules.split import estimated_slots, merged, split_by_speed
from schedules.timing.bubbles import timed_makespan

from sim.profiles import MeasuredProfile
from sim.windows import full_pipeline


@lru_cache(maxsize=None)
def config_ms(profile, depth: int, shapes: tuple[tuple[int, ...], ...], redundancy: str, frc: str,
               sync: str) -> float:
    """The slowest pipeline's iteration, each pipeline given its share of the global
    microbatches by speed; `shapes`: each pipeline's stages per node, in stage order."""
    pipelines = [tuple(i for i, count in enumerate(sizes) for _ in range(count)) for sizes in shapes]
    total = getattr(profile, "microbatches", None) or 4 * len(pipelines)
    if isinstance(profile, MeasuredProfile):  # measured full pipelines, scaled by the estimate
        shares = split_by_speed(total, pipelines)
        full = iteration_ms(profile, depth, len(pipelines), redundancy, False, frc, sync)
        even = estimated_slots(tuple(range(depth)), -(-total // len(pipelines)))
        return full * max(estimated_slots(p, len(m)) for p, m in zip(pipelines, shares)) / even

    def duration(merged_stages: tuple[int, ...], microbatches: int) -> float:
        return pipeline_ms(profile, depth, len(pipelines), merged_stages, microbatches, redundancy, frc, sync)
    # split by each pipeline's merged stages, found once: the split asks a pipeline's time at every step
    stages = [tuple(sorted(merged(p))) for p in pipelines]
    shares = split_by_speed(total, stages, duration)
    return max(duration(p, len(m)) for p, m in zip(stages, shares))


@lru_cache(maxsize=None)
def pipeline_ms(profile, depth: int, pipelines: int, merged_stages: tuple[int, ...], microbatches: int,
                 redundancy: str, frc: str, sync: str) -> float:
    """One pipeline's iteration under the cost model of `pipelines` pipelines."""
    options = ScheduleOptions(redundancy=redundancy, frc=frc, sync=sync)
    schedule = compile_schedule(depth, microbatches, merged_stages, options, profile.cost(depth, pipelines))
    return length(schedule)


@lru_cache(maxsize=None)
def iteration_ms(profile, depth: int, pipelines: int, redundancy: str, merged: bool, frc: str, sync: str) -> float:
    if isinstance(profile, MeasuredProfile):
        known = dict(profile.iteration_ms)
        return known.get(pipelines) or known[min(known, key=lambda d: abs(d - pipelines))]
    microbatches = math.ceil(profile.microbatches / pipelines)
    cost = profile.cost(depth, pipelines)
    failed = (1,) if merged else ()
    options = ScheduleOptions(redundancy=redundancy if not merged else "eager", frc=frc, sync=sync)
    schedule = compile_schedule(depth, microbatches, failed, options, cost)
    return length(schedule)


def length(schedule) -> float:
    """A compiled iteration's makespan by the engine's timing rule without its checks
    (schedules/timing/bubbles.py `timed_makespan`): the engine's number for the
    schedules the compiler builds, a fraction of its time on the thousands of shapes
    a fleet passes through."""
    return timed_makespan(schedule.streams, schedule.cost)


@lru_cache(maxsize=None)
def uncovered_share(profile, depth: int, pipelines: int, frc: str, sync: str) -> float:
    """The mean share of microbatches without FRC over the nodes of a full pipeline
    (a measured profile: placed on the compiler's default cost model)."""
    if frc == Frc.ALL:
        return 0.0
    schedule, _ = full_pipeline(profile, depth, pipelines, "eager", frc, sync)
    covered = [len(schedule.frc_microbatches(n)) for n in schedule.streams]
    return 1 - sum(covered) / (len(covered) * schedule.microbatches)
