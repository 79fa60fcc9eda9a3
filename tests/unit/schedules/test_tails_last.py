"""A replanned stream with its tail last (schedules/recovery.py's tails_last): for
every failure point of small pipelines, the survivors' streams, cut where each
stands and reordered, still run to the end in the schedule simulator; and every
node's reduces left to run go in ascending stage order, the one order all
pipelines share (a node reducing stage 2 while its partner in another pipeline
reduces stage 0 first would wait for it forever)."""
import pytest

from schedules.compiler import compile_recovery, compile_schedule
from schedules.ir import Instr, Op
from schedules.layout import ScheduleError
from schedules.lower import is_tail
from schedules.options import ReplicaSync, ScheduleOptions
from schedules.recovery import tails_last
from schedules.timing.engine import Engine


def owed_reduces(stream: list[Instr]) -> list[int]:
    return [i.stage for i in stream if i.op is Op.REDUCE_GRADS]


def cut_at(stream: list[Instr], resume_at: int, before_tail: bool) -> int:
    """Where a survivor stands when it replans: where its recovery starts, or (as
    slow as it may be) before the first tail instruction of what it ran there."""
    if not before_tail:
        return resume_at
    return next((i for i, x in enumerate(stream[:resume_at]) if is_tail(x)), resume_at)


CASES = [(2, 3, (), "eager", "end"), (3, 3, (), "eager", "end"), (3, 4, (), "lazy", "end"),
         (4, 4, (), "eager", "end"), (5, 3, (2,), "eager", "end"), (3, 4, (), "eager", "next"),
         (4, 3, (), "lazy", "next")]


@pytest.mark.parametrize("P,M,failed,redundancy,sync", CASES)
def test_every_failure_point_runs_with_the_tails_last_in_stage_order(P, M, failed, redundancy, sync):
    options = ScheduleOptions(redundancy=redundancy, sync=sync)
    late = options.sync is ReplicaSync.NEXT
    base = compile_schedule(P, M, failed, options)
    checked = 0
    for d, dead_stream in base.streams.items():
        if (d - 1) % P in failed or (d + 1) % P in failed:
            continue
        for k in range(len(dead_stream) + 1):
            try:
                rec = compile_recovery(P, M, d, k, failed, options)
            except ScheduleError:
                continue  # refused by name (a late sync in flight): not a replan
            for before_tail in (False, True):
                streams = {}
                for n, s in rec.streams.items():
                    pc = cut_at(s, rec.resume_at[n], before_tail)
                    streams[n] = s[:pc] + tails_last(s[pc:], late)
                    assert sorted(streams[n]) == sorted(s)  # nothing dropped or added
                    owed = owed_reduces(streams[n][pc:])
                    assert owed == sorted(owed), (d, k, n, streams[n][pc:])
                engine = Engine(rec.layout, M, rec.cost, dead=(d, k), expect_frc=options.every_frc, late_sync=late)
                engine.run({**streams, d: dead_stream[:k]})  # raises on a deadlock or any check
                checked += 1
    assert checked > 0


def test_the_taker_of_stage_0_reduces_stage_0_first_even_with_its_own_stage_in_its_prefix():
    """The case chaos seed 10 met: P=3, the first stage's node dies once all three of
    its activations are out; the last stage's node, which takes stage 0 over, may
    already have run its own stage's reduce in the prefix the compiler gives it."""
    options = ScheduleOptions(redundancy="eager")
    base = compile_schedule(3, 3, (), options)
    k = 9  # node 0 before its instruction 9: its three activations sent
    rec = compile_recovery(3, 3, 0, k, (), options)
    taker = rec.streams[2]
    assert owed_reduces(taker) == [2, 0]  # as compiled: the own stage's reduce in the prefix
    pc = cut_at(taker, rec.resume_at[2], before_tail=True)
    assert owed_reduces(taker[:pc] + tails_last(taker[pc:])) == [0, 2]
    assert owed_reduces(base.streams[2]) == [2]
