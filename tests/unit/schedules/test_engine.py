"""The engine against closed-form pipeline results, and its checks against
deliberately broken streams."""
import pytest

from schedules import ir
from schedules.timing.checks import ValidationError, timeline
from schedules.compiler import compile_eval, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.timing.engine import Engine, validate
from schedules.ir import Op
from schedules.options import ScheduleOptions

# No latency and free bookkeeping: the textbook pipeline model.
IDEAL = CostModel(forward=1.0, backward=2.0, transfer=0.0, swap=0.0, step=0.0, sync_transfer=0.0)


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
@pytest.mark.parametrize("P,M", [(2, 1), (4, 8), (8, 3), (6, 16)])
def test_makespan_and_bubble_match_the_closed_form(order, P, M):
    r = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy="off", order=order, split="off"), cost=IDEAL), IDEAL)
    f, b = 1.0, 2.0
    assert r.makespan == pytest.approx((M + P - 1) * (f + b))
    for node in range(P):
        assert r.bubble[node] == pytest.approx((P - 1) / (M + P - 1))


@pytest.mark.parametrize("P,M", [(4, 8), (5, 3)])
def test_peak_live_activations(P, M):
    one = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy="off", split="off"), cost=IDEAL), IDEAL)
    gp = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy="off", order="gpipe", split="off"), cost=IDEAL), IDEAL)
    for s in range(P):
        assert one.peak_live[s] == min(P - s, M)
        assert gp.peak_live[s] == M


def _streams(P=3, M=4, redundancy="off", frc="bubbles"):
    """(Whole backwards; the split ones' checks are in tests/integration/test_early_grads.py.)"""
    s = compile_schedule(P, M, options=ScheduleOptions(redundancy=redundancy, frc=frc, split="off"))
    return s.layout, M, {n: list(v) for n, v in s.streams.items()}


def _index(stream, op, **fields):
    return next(i for i, x in enumerate(stream) if x.op is op and all(getattr(x, k) == v for k, v in fields.items()))


def test_fixture_streams_are_valid():
    layout, M, streams = _streams()
    validate(layout, M, streams)


def test_missing_receive_is_caught():
    layout, M, streams = _streams()
    del streams[1][_index(streams[1], Op.RECV_ACT, mb=2)]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "use-before-produce"


def test_a_broken_check_prints_the_timeline_with_the_failing_step_marked():
    """Node 1's forward of microbatch 2 loses its receive: the error's text is a grid
    of what every node ran, node 1's column ending at the forward, marked, on the
    row after the instructions it did run (compared with the valid stream itself)."""
    layout, M, streams = _streams()
    k = _index(streams[1], Op.RECV_ACT, mb=2)
    del streams[1][k]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    text = str(e.value)
    assert text.splitlines()[0].startswith("use-before-produce: node 1: forward s1 mb2")
    grid = text.splitlines()[1:]
    assert [c.strip() for c in grid[0].split("|")] == ["step", "node 0", "node 1", "node 2"]
    rows = {int(line.split("|")[0]): [c.strip() for c in line.split("|")[1:]]
            for line in grid[2:] if line.split("|")[0].strip().isdigit()}
    marked = [(r, col) for r, cells in rows.items() for col, c in enumerate(cells) if c.startswith(">>")]
    assert marked == [(k, 1)] and rows[k][1] == f">> {streams[1][k]} <<"
    assert all(rows[r][1] == str(streams[1][r]) for r in rows if r < k)  # what node 1 ran before it, in order


def test_the_timeline_shows_the_marked_step_however_far_other_nodes_ran():
    load = [ir.Instr(Op.LOAD, mb=i) for i in range(100)]
    text = timeline({0: load, 1: load[:3]}, {1: ir.Instr(Op.FORWARD, 0, 3)})
    rows = [line for line in text.splitlines() if line.split("|")[0].strip().isdigit()]
    assert len(rows) <= 16 and any(line.split("|")[2].strip() == ">> forward s0 mb3 <<" for line in rows)
    assert text.splitlines()[-1] == " ... 93 steps after"


def test_swapped_receives_are_out_of_order():
    layout, M, streams = _streams()
    i, j = _index(streams[1], Op.RECV_ACT, mb=0), _index(streams[1], Op.RECV_ACT, mb=1)
    streams[1][i], streams[1][j] = streams[1][j], streams[1][i]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "out-of-order"


def test_backward_before_its_forward_is_use_before_produce():
    layout, M, streams = _streams()
    b = streams[2].pop(_index(streams[2], Op.BACKWARD, mb=1))
    streams[2].insert(0, b)
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "use-before-produce"


def test_waiting_before_sending_deadlocks():
    layout, M, streams = _streams()
    recv = streams[0].pop(_index(streams[0], Op.RECV_GRAD, mb=0))
    streams[0].insert(_index(streams[0], Op.SEND_ACT, mb=0), recv)
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "deadlock"


def test_unreceived_message_is_unmatched():
    layout, M, streams = _streams()
    streams[0].insert(_index(streams[0], Op.SEND_ACT, mb=3) + 1, ir.send_act(0, 3, 2))
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "unmatched"


def test_a_microbatch_left_out_of_the_gradients_is_caught():
    layout, M, streams = _streams(P=2)
    # node 1 never computes microbatch 2's backward nor sends its gradient; node 0 skips it too
    streams[1] = [x for x in streams[1] if not (x.op in (Op.BACKWARD, Op.SEND_GRAD) and x.mb == 2)]
    streams[0] = [x for x in streams[0] if not (x.op in (Op.BACKWARD, Op.RECV_GRAD) and x.mb == 2)]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "exactly-once" and "missing [2]" in str(e.value)


def test_replica_that_is_never_stepped_is_caught():
    layout, M, streams = _streams(redundancy="eager")
    streams[0] = [x for x in streams[0] if not (x.op is Op.OPTIMIZER_STEP and x.redundant)]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "not-stepped"


def test_backward_from_swapped_out_intermediates_needs_a_swap_in():
    layout, M, streams = _streams(redundancy="eager")
    s = streams[0]
    s.insert(_index(s, Op.SWAP_OUT, stage=1, mb=0) + 1, ir.backward(1, 0, redundant=True))
    with pytest.raises(ValidationError, match="no resident forward state"):
        validate(layout, M, streams)


def test_work_after_the_reduce_is_caught():
    layout, M, streams = _streams()
    s = streams[2]
    at = _index(s, Op.REDUCE_GRADS) + 1
    s[at:at] = [ir.forward(2, 0), ir.backward(2, 0)]  # inputs still there: only the timing is wrong
    with pytest.raises(ValidationError, match="after its gradients were reduced"):
        validate(layout, M, streams)


def test_dropped_frc_and_leftover_state_are_caught():
    layout, M, streams = _streams(redundancy="eager", frc="all")
    s = streams[1]
    i = _index(s, Op.FORWARD, stage=2, mb=3, redundant=True)
    del s[i:i + 2]  # the FRC and its swap-out
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "missing-frc"
    layout, M, streams = _streams(redundancy="eager")
    del streams[1][max(i for i, x in enumerate(streams[1]) if x.op is Op.SWAP_OUT and x.stage == 2)]
    with pytest.raises(ValidationError) as e:
        validate(layout, M, streams)
    assert e.value.kind == "leak"


def test_fast_timing_pass_agrees_with_the_simulator():
    from schedules.timing.fast import start_times
    cost = CostModel(forward=(1.0, 0.5, 2.0, 1.5), backward=(2.0, 1.0, 3.0, 2.5), transfer=0.3)
    sched = compile_schedule(4, 6, cost=cost)
    report = simulate(sched)
    fast = start_times(sched.streams, cost)
    for node, stream in sched.streams.items():
        assert [sp.start for sp in report.spans if sp.node == node] == pytest.approx(fast[node])


@pytest.mark.parametrize("redundancy, sync", [("off", "end"), ("eager", "end"), ("lazy", "next"), ("eager", "next")])
def test_the_last_end_kept_alone_is_the_engine_s_makespan(redundancy, sync):
    """finish_time keeps no start: it must end where the checked engine's run ends,
    and where the starts it skips would put the last node's end, on both caches of
    the cost model's table (the first call fills it, the second reads it)."""
    from schedules.timing.bubbles import makespan
    from schedules.timing.fast import finish_time, start_times
    def model():
        return CostModel(forward=(1.0, 0.5, 2.0, 1.5, 0.7), backward=(2.0, 1.0, 3.0, 2.5, 1.1), transfer=0.3,
                         sync_transfer=0.9, step=0.4)
    cost, fresh = model(), model()  # fresh: an empty table
    sched = compile_schedule(5, 7, options=ScheduleOptions(redundancy=redundancy, sync=sync), cost=cost)
    assert not fresh.timing_table()
    ends = [finish_time(sched.streams, fresh), finish_time(sched.streams, fresh), finish_time(sched.streams, cost)]
    assert ends[0] == ends[1] == ends[2] == makespan(sched.streams, start_times(sched.streams, cost), cost)
    assert ends[0] == pytest.approx(simulate(sched).makespan)


def test_a_model_made_from_another_times_by_its_own_numbers():
    """dataclasses.replace copies init fields: the models' caches are not among them,
    so a model with another forward or sync transfer does not read the first's."""
    from dataclasses import replace
    from schedules.timing.bubbles import timed_makespan
    base = CostModel(sync_transfer=0.1)
    options = ScheduleOptions(redundancy="eager", sync="next")
    streams = compile_schedule(3, 4, options=options, cost=base).streams
    timed_makespan(streams, base)  # fills base's caches
    for changed in (replace(base, sync_transfer=5.0), replace(base, forward=3.0)):
        assert not changed.timing_table()
        fresh = CostModel(**{k: getattr(changed, k) for k in ("forward", "sync_transfer")})
        assert timed_makespan(streams, changed) == timed_makespan(streams, fresh) > timed_makespan(streams, base)


def test_cost_model_inputs_are_checked():
    from schedules.layout import ScheduleError
    assert CostModel(forward=[1, 2]).forward == (1.0, 2.0)
    with pytest.raises(ScheduleError, match="negative"):
        CostModel(transfer=-1)
    with pytest.raises(ScheduleError, match="3 per-stage values for 4 stages"):
        compile_schedule(4, 2, cost=CostModel(forward=(1, 1, 1)))


def test_cached_schedules_are_not_shared():
    a = compile_schedule(3, 2).streams[0]
    a.clear()
    assert len(compile_schedule(3, 2).streams[0]) > 0


def test_evaluation_streams_are_checked_too():
    """A forward left out, or run twice, is caught in a forward-only run."""
    sched = compile_eval(3, 2)
    assert simulate(sched).makespan == pytest.approx(4 * 1.0 + 2 * 0.05)  # M + P - 1 forwards, two hops
    streams = {n: list(v) for n, v in sched.streams.items()}
    last = streams[2]
    del last[_index(last, Op.FORWARD, stage=2, mb=1)]
    with pytest.raises(ValidationError, match="exactly-once"):
        Engine(sched.layout, 2, evaluation=True).run(streams)
    streams = {n: list(v) for n, v in sched.streams.items()}
    streams[0].append(ir.forward(0, 0))
    with pytest.raises(ValidationError, match=r"\(stage 0, mb 0\) ran 2 times"):
        Engine(sched.layout, 2, evaluation=True).run(streams)
