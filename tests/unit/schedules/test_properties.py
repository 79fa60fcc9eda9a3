"""Property tests: every stream the compiler emits passes the validator, for P in
2..16, M in 1..64, any non-adjacent set of failed nodes, and any mid-iteration
failure of any survivable node at any instruction; evaluation streams too."""
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.compiler import compile_eval, compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.ir import Op
from schedules.options import ScheduleOptions

costs = st.builds(CostModel, forward=st.floats(0, 4), backward=st.floats(0, 4), transfer=st.floats(0, 3),
                  swap=st.floats(0, 1), step=st.floats(0, 1), sync_transfer=st.floats(0, 1))


@st.composite
def layouts(draw):
    P = draw(st.integers(2, 16))
    M = draw(st.integers(1, 64))
    failed: set[int] = set()
    for n in draw(st.lists(st.integers(0, P - 1), max_size=P // 2)):
        if (n - 1) % P not in failed and (n + 1) % P not in failed and n not in failed:
            failed.add(n)
    return P, M, tuple(sorted(failed))


@settings(max_examples=120)
@given(layouts(), st.sampled_from(["1f1b", "gpipe"]), st.sampled_from(["eager", "lazy", "off"]))
def test_compiled_streams_validate(layout, order, redundancy):
    P, M, failed = layout
    sched = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy=redundancy, order=order))
    report = simulate(sched)
    assert set(report.finished) == set(range(P)) - set(failed) and all(report.finished.values())


@settings(max_examples=80)
@given(layouts(), st.sampled_from(["1f1b", "gpipe"]), costs, st.sampled_from(["eager", "lazy"]), st.data())
def test_any_mid_iteration_failure_recovers(layout, order, cost, redundancy, data):
    P, M, failed = layout
    base = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy=redundancy, order=order), cost=cost)
    candidates = [d for d in base.streams if (d - 1) % P not in failed and (d + 1) % P not in failed]
    if not candidates:
        return
    d = data.draw(st.sampled_from(candidates))
    k = data.draw(st.integers(0, len(base.streams[d])))
    rec = compile_recovery(P, M, d, k, failed, options=ScheduleOptions(redundancy=redundancy, order=order), cost=cost)
    report = simulate(rec)
    assert all(report.finished.values())


@settings(max_examples=200)
@given(layouts(), costs)
def test_evaluation_streams_validate_and_only_run_forwards(layout, cost):
    """Forward-only: each stage runs each microbatch once on its owner (the
    validator), nothing is stepped, and the node of the last stage has the labels."""
    P, M, failed = layout
    sched = compile_eval(P, M, failed, cost=cost)
    report = simulate(sched)
    assert set(report.finished) == set(range(P)) - set(failed) and all(report.finished.values())
    ops = {i.op for s in sched.streams.values() for i in s}
    assert ops <= {Op.LOAD, Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT}
    last = sched.layout.owner(P - 1)
    assert sorted(i.mb for i in sched.streams[last] if i.op is Op.LOAD) == list(range(M))
