"""The maximal cut by counting messages (schedules/timing/cut.py) against the engine
running every node as far as it can with the dead node stopped, and the lean engine
run that recovery uses against the fully checked one."""
import random

import pytest

from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.layout import ScheduleError
from schedules.options import ScheduleOptions
from schedules.timing.cut import Matches
from schedules.timing.engine import Engine

SHAPES = [(2, 4, ()), (3, 6, ()), (4, 8, ()), (5, 7, (1,)), (6, 12, (2,)), (8, 16, (1, 4))]
OPTIONS = [dict(redundancy="eager"), dict(redundancy="lazy"), dict(redundancy="eager", sync="next"),
           dict(redundancy="eager", split="off"), dict(redundancy="eager", ahead=True)]


def engine_cut(schedule, dead: int, before: int, late: bool) -> dict[int, int]:
    report = Engine(schedule.layout, schedule.microbatches, schedule.cost, dead=(dead, before),
                    late_sync=late).run(schedule.streams, allow_stuck=True)
    return {n: len(s) for n, s in report.streams.items()}


@pytest.mark.parametrize("stages,microbatches,failed", SHAPES)
@pytest.mark.parametrize("given", OPTIONS, ids=lambda g: "-".join(f"{v}" for v in g.values()))
def test_cut_is_where_the_engine_stops(stages, microbatches, failed, given):
    schedule = compile_schedule(stages, microbatches, failed, ScheduleOptions(**given))
    matches, rng = Matches(schedule.streams), random.Random(stages * 100 + microbatches)
    points = [(d, k) for d, s in schedule.streams.items() for k in (0, 1, len(s) // 2, len(s))]
    points += [(d, rng.randrange(len(s) + 1)) for d, s in schedule.streams.items() for _ in range(6)]
    for dead, before in points:
        assert matches.cut(dead, before) == engine_cut(schedule, dead, before, given.get("sync") == "next"), \
            (dead, before)


def test_a_node_waiting_on_the_dead_one_stops_at_that_receive():
    schedule = compile_schedule(4, 8, (), ScheduleOptions(redundancy="eager"))
    cut = Matches(schedule.streams).cut(2, 0)  # node 2 ran nothing: node 3 gets no activation
    first_recv = next(pc for pc, i in enumerate(schedule.streams[3]) if i.op.value == "recv_act")
    assert cut[3] == first_recv
    assert cut[2] == 0


@pytest.mark.parametrize("given", OPTIONS[:3], ids=lambda g: "-".join(f"{v}" for v in g.values()))
def test_recovery_plans_validate_in_the_checked_engine(given):
    """recover() times the fixed streams without checks; every plan it makes must
    still pass every check of the full engine (simulate)."""
    options, rng = ScheduleOptions(**given), random.Random(7)
    for stages, microbatches, failed in SHAPES[1:]:
        base = compile_schedule(stages, microbatches, failed, options)
        for dead, stream in base.streams.items():
            for before in {0, rng.randrange(len(stream) + 1), len(stream)}:
                try:
                    plan = compile_recovery(stages, microbatches, dead, before, failed, options)
                except ScheduleError:
                    continue  # unsurvivable (late sync not landed), said as such
                simulate(plan)
