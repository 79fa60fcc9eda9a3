"""The runtime ledger's redundancy (commands/status/runstats.py `redundant_share`):
the share of an epoch's iteration that its mode adds over off, against the
schedule simulator's own iteration times, and against the times auto measured."""
import pytest

from agents.modes import ModeStats
from bamboo.control.assignment import Assignment
from bamboo.control.config import JobConfig
from bamboo.control.protocol import ModeChoice
from commands.status.jobview import Look
from commands.status.runstats import redundant_share
from schedules.compiler import compile_schedule, simulate
from schedules.options import ScheduleOptions


def look(redundancy: str, modes: dict | None = None) -> Look:
    cfg = JobConfig.of(name="tiny", stages=3, microbatches=4, redundancy=redundancy)
    return Look("j", cfg, 0.0, assignments={0: Assignment(0, 0, ((0, 1, 2),))}, modes=modes or {})


def makespan(mode: str) -> float:
    return simulate(compile_schedule(3, 4, (), ScheduleOptions(redundancy=mode))).makespan


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_before_any_measurement_it_is_the_cost_model_s(mode):
    view = look(mode)
    assert redundant_share(view, view.assignments[0]) == pytest.approx(1 - makespan("off") / makespan(mode))
    assert 0 < redundant_share(view, view.assignments[0]) < 1


def test_off_adds_nothing_and_an_unknown_mode_from_etcd_adds_nothing():
    view = look("off")
    assert redundant_share(view, view.assignments[0]) == 0.0
    forged = Assignment(0, 0, ((0, 1, 2),), redundancy="<script>")
    assert redundant_share(view, forged) == 0.0


def test_the_times_auto_measured_decide_it_where_both_modes_ran():
    """Eager measured at 1.25 s an iteration and off at 1.0 s: a fifth of eager's time."""
    stats = ModeStats(seconds={"eager": 1.25, "off": 1.0})
    view = look("auto", {0: ModeChoice("eager", stats.__dict__)})
    epoch = Assignment(1, 5, ((0, 1, 2),), redundancy="eager")
    assert redundant_share(view, epoch) == pytest.approx(0.2)
