"""Pass (f), mid-iteration: every failure point of small pipelines, checked by the
simulator (which raises on deadlock, lost or double-counted microbatches)."""
import pytest

from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.ir import INPUT_GRADS, Op
from schedules.layout import ScheduleError
from schedules.options import ScheduleOptions


def _points(P, M, failed=(), options=ScheduleOptions(), cost=CostModel()):
    base = compile_schedule(P, M, failed, options, cost)
    for d in base.streams:
        if (d - 1) % P in failed or (d + 1) % P in failed:
            continue
        for k in range(len(base.streams[d]) + 1):
            yield base, d, k


@pytest.mark.parametrize("P,M,failed", [(2, 1, ()), (2, 3, ()), (3, 2, ()), (3, 4, ()), (4, 4, ()),
                                        (4, 5, ()), (5, 3, (0,)), (5, 4, (2,)), (6, 3, (1, 4))])
def test_every_failure_point_recovers(P, M, failed):
    for base, d, k in _points(P, M, failed):
        rec = compile_recovery(P, M, d, k, failed=failed)
        report = simulate(rec)  # raises on any violation
        assert set(rec.streams) == set(base.streams) - {d}
        for n, stream in rec.streams.items():
            # what a survivor ran before the cut is what it was told to run
            assert stream[:rec.resume_at[n]] == base.streams[n][:rec.resume_at[n]]
            assert not any(x.peer == d for x in stream[rec.resume_at[n]:])
        assert all(report.finished.values())


def test_predecessor_recomputes_all_lost_gradients_and_successor_resends():
    P, M, d = 4, 6, 2
    base = compile_schedule(P, M)
    k = next(i for i, x in enumerate(base.streams[d]) if x.op in INPUT_GRADS and x.mb == 3)
    rec = compile_recovery(P, M, d, k)
    p, q = rec.streams[1][rec.resume_at[1]:], rec.streams[3][rec.resume_at[3]:]
    assert sorted(x.mb for x in p if x.op is Op.BACKWARD and x.stage == d) == list(range(M))
    assert all(x.redundant for x in p if x.op is Op.BACKWARD and x.stage == d and x.mb <= 3)
    already_sent = [x.mb for x in base.streams[3][:rec.resume_at[3]] if x.op is Op.SEND_GRAD]
    resent = [x.mb for x in q if x.op is Op.SEND_GRAD][:len(already_sent)]
    assert already_sent and resent == already_sent
    assert all(x.peer == 1 for x in q if x.op in (Op.SEND_GRAD, Op.RECV_ACT))
    assert [x.op for x in p if x.op is Op.REDUCE_GRADS] and {x.stage for x in p if x.op is Op.REDUCE_GRADS} == {1, 2}


def test_failure_after_the_replica_sync_needs_no_recomputation():
    P, M, d = 3, 3, 1
    base = compile_schedule(P, M)
    rec = compile_recovery(P, M, d, len(base.streams[d]))
    assert not any(x.op is Op.BACKWARD and x.stage == d for x in rec.streams[0])
    simulate(rec)


def test_recovery_is_deterministic():
    a = compile_recovery(5, 7, 3, 20)
    b = compile_recovery(5, 7, 3, 20, cost=CostModel(forward=1.0))  # equal model, new object
    assert a.streams == b.streams and a.resume_at == b.resume_at


@pytest.mark.parametrize("kwargs,message", [
    (dict(fail_node=2, fail_before=3, failed=(1,)), "adjacent"),
    (dict(fail_node=1, fail_before=3, failed=(1,)), "not a live node"),
    (dict(fail_node=1, fail_before=999), "out of range"),
    (dict(fail_node=1, fail_before=2, options=ScheduleOptions(redundancy="off")), "not survivable"),
])
def test_unsurvivable_or_bad_failures_are_refused(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        compile_recovery(4, 4, **kwargs)


@pytest.mark.parametrize("P,M,failed,d,k,cost", [
    # node 3 runs stages 0 and 3; it waits on d's future work before taking in
    # an activation d already sent: that message must be dropped and re-sent.
    (4, 5, (0,), 2, 15, CostModel(forward=3.0, backward=0.2, transfer=2.0)),
    (4, 3, (0,), 2, 12, CostModel(forward=(1, 1, 1, .1), backward=(2, .2, .2, .2))),
    (3, 3, (), 1, 12, CostModel(forward=0, backward=0, transfer=0, swap=0, step=0, sync_transfer=0)),
])
def test_recovery_when_a_sent_activation_was_not_yet_taken_in(P, M, failed, d, k, cost):
    rec = compile_recovery(P, M, d, k, failed, cost=cost)
    assert all(simulate(rec).finished.values())


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_every_failure_point_recovers_under_uneven_costs(order):
    cost = CostModel(forward=(0.5, 2.0, 1.0), backward=(1.0, 4.0, 0.5), transfer=0.7, swap=0.3)
    for frc in ("bubbles", "all"):
        for base, d, k in _points(3, 4, (), ScheduleOptions(order=order, frc=frc), cost):
            simulate(compile_recovery(3, 4, d, k, options=ScheduleOptions(order=order, frc=frc), cost=cost))
