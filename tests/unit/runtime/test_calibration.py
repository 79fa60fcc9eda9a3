"""FRC placed by measured op times (bamboo/runtime/calibration.py).

The cost model comes from the nodes' reports, checked against medians worked out
by hand; placements with measured-looking costs (uneven stages, slow swaps, a
margin on FRC) are checked by the validating simulator at every death point, as
the default model's are in test_recovery.py. A real eager job that switches to the
measured placement and keeps the single-process math is in test_runtime.py."""
import random

import pytest

from bamboo.control.protocol import Report
from bamboo.runtime.calibration import FRC_MARGIN, OpTimes, cost_model, propose
from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.ir import Instr, Op
from schedules.options import ScheduleOptions


def _report(op_ms, events=()):
    return Report(rss_mb=1.0, time=0.0, epoch=0, events=list(events), op_ms=op_ms)


def test_op_times_report_medians_per_op_and_stage():
    times = OpTimes()
    for s in (0.002, 0.004, 0.003):
        times.add(Instr(Op.FORWARD, 1, 0), s)
    times.add(Instr(Op.FORWARD, 2, 0, redundant=True), 0.005)
    times.add(Instr(Op.SEND_ACT, 1, 0, 2), 0.0004)
    times.add(Instr(Op.SEND_GRAD, 1, 0, 0), 0.0006)
    times.add(Instr(Op.RECV_GRAD, 2, 0, 2), 1.0)  # a wait, not work: not timed
    times.add(Instr(Op.OPTIMIZER_STEP, 1), 0.001)
    times.add(Instr(Op.OPTIMIZER_STEP, 2, redundant=True), 0.009)  # the replica's: not the stage's step
    assert times.medians_ms() == {"forward/1": 3.0, "forward_r/2": 5.0, "send": 0.5, "step": 1.0,
                                  "optimizer_step": 9.0}


def test_a_pipelines_cost_model_comes_from_its_own_nodes_reports():
    node0 = {"forward/0": 2.0, "backward/0": 4.0, "forward_r/1": 3.3, "swap_out": 0.5, "send": 0.3, "step": 0.6}
    node1 = {"forward/1": 3.0, "backward/1": 5.0, "forward_r/0": 2.0, "swap_out": 0.7, "send": 0.5, "step": 0.8,
             "load": 0.1}
    other = {"forward/0": 9.0, "backward/0": 9.0, "send": 9.0}, {"forward/1": 9.0, "backward/1": 9.0}
    reports = {10: _report(node0), 11: _report(node1), 20: _report(other[0]), 21: _report(other[1])}
    costs = propose(reports, ((10, 11), (20, 21)))
    model = cost_model(costs, 0, 2)
    assert model.forward == (2.0, 3.0) and model.backward == (4.0, 5.0)
    assert model.swap == pytest.approx(0.6) and model.send == model.transfer == pytest.approx(0.4)
    assert model.load == 0.1 and model.step == pytest.approx(0.7)
    # FRC ran 1.1x and 1.0x its stage's forward: the median, 1.05, times the margin
    assert model.frc_factor == pytest.approx(FRC_MARGIN * 1.05)
    assert cost_model(costs, 1, 2).forward == (9.0, 9.0)
    assert cost_model(costs, 0, 3) is None  # a cost model for another depth is not used


def test_split_backwards_are_timed_by_their_two_passes():
    """A stage whose backwards all ran split (schedules/early_grads.py) costs the sum
    of its two passes' medians; the input pass's share is measured too."""
    times = OpTimes()
    times.add(Instr(Op.BACKWARD_INPUT, 1, 0), 0.003)
    times.add(Instr(Op.BACKWARD_WEIGHT, 1, 0), 0.002)
    assert times.medians_ms() == {"backward_input/1": 3.0, "backward_weight/1": 2.0}
    node0 = {"forward/0": 2.0, "backward/0": 4.0}
    node1 = {"forward/1": 3.0, **times.medians_ms()}
    model = cost_model(propose({0: _report(node0), 1: _report(node1)}, ((0, 1),)), 0, 2)
    assert model.backward == (4.0, 5.0) and model.input_share == pytest.approx(0.6)
    half = {"forward/1": 3.0, "backward_input/1": 3.0}  # a weight pass never timed: no model
    assert propose({0: _report(node0), 1: _report(half)}, ((0, 1),)) is None


@pytest.mark.parametrize("reports", [
    {0: _report({"forward/0": 1.0, "backward/0": 2.0}), 1: _report(None)},             # a node did not report
    {0: _report({"forward/0": 1.0, "backward/0": 2.0}),
     1: _report({"forward/1": 1.0, "backward/1": 2.0}, events=[{"type": "failover"}])},  # a merged stream
    {0: _report({"forward/0": 1.0, "backward/0": 2.0}), 1: _report({"backward/1": 2.0})},  # a stage not timed
])
def test_no_cost_model_from_incomplete_or_disturbed_reports(reports):
    assert propose(reports, ((0, 1),)) is None


def _measured_like(rng, P):
    forward = [rng.uniform(1.0, 3.0) for _ in range(P)]
    return CostModel(forward=forward, backward=[f * rng.uniform(1.0, 2.5) for f in forward],
                     transfer=rng.uniform(0.0, 0.5), send=rng.uniform(0.0, 0.5), swap=rng.uniform(0.1, 1.0),
                     load=rng.uniform(0.0, 0.2), step=rng.uniform(0.1, 1.0), sync_transfer=rng.uniform(0.0, 2.0),
                     frc_factor=FRC_MARGIN * rng.uniform(1.0, 1.3))


@pytest.mark.parametrize("seed", range(6))
def test_placements_under_measured_costs_recover_from_every_death_point(seed):
    rng = random.Random(seed)
    P, M = rng.choice([2, 3, 4]), rng.choice([3, 4, 6])
    cost = _measured_like(rng, P)
    base = compile_schedule(P, M, (), options=ScheduleOptions(redundancy="eager"), cost=cost)
    lazy = simulate(compile_schedule(P, M, (), options=ScheduleOptions(redundancy="lazy"), cost=cost))
    assert simulate(base).makespan <= lazy.makespan * (1 + 1e-12)  # FRC only in idle time
    for d, stream in base.streams.items():
        for k in range(len(stream) + 1):
            simulate(compile_recovery(P, M, d, k, cost=cost))  # raises on any violation
