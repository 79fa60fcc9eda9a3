"""The order compute ahead runs (schedules/overlap.py): its period against a brute
force over two-stage orders built by hand, the same work as 1F1B's, and every failure
point of it recovered."""
import itertools

import pytest

from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.ir import Op
from schedules.options import ScheduleOptions
from schedules.overlap import period
from schedules.timing.bubbles import makespan
from schedules.timing.fast import start_times

AHEAD = ScheduleOptions(redundancy="off", ahead=True)
LARGE = CostModel(forward=486.7, backward=1038.0, input_share=563 / 1038, step=150.0, transfer=5.0)  # bench_passes


def _two_stage_period(warm: int, lag: int, M: int, c: CostModel) -> float:
    """A by-hand model of two stages run back to back: stage 0 warms up with `warm`
    forwards then alternates backward and forward, whole backwards; the last stage
    runs F, input pass, and the weight pass `lag` microbatches later. Independent of
    the compiler: its own event loop over (op, microbatch) lists."""
    F, B, step, lat = c.forward, c.backward, c.step, c.transfer
    Bi, W = B * c.input_share, B * (1 - c.input_share)
    first = [("F", i) for i in range(warm)]
    nxt = warm
    for i in range(M):
        first.append(("B", i))
        if nxt < M:
            first.append(("F", nxt))
            nxt += 1
    last = []
    for i in range(M):
        last += [("F", i), ("B", i)] + ([("W", i - lag)] if i >= lag else [])
    last += [("W", i) for i in range(max(0, M - lag), M)]
    ends, t0, t1 = [], 0.0, 0.0
    for _ in range(4):
        done0, done1, i0, i1 = {}, {}, 0, 0
        while i0 < len(first) or i1 < len(last):
            if i0 < len(first):
                kind, mb = first[i0]
                if kind == "F" or ("B", mb) in done1:
                    t0 = max(t0, done1[("B", mb)] + lat if kind == "B" else t0) + (F if kind == "F" else B)
                    done0[(kind, mb)], i0 = t0, i0 + 1
            if i1 < len(last):
                kind, mb = last[i1]
                if kind != "F" or ("F", mb) in done0:
                    t1 = max(t1, done0[("F", mb)] + lat if kind == "F" else t1) + {"F": F, "B": Bi, "W": W}[kind]
                    done1[(kind, mb)], i1 = t1, i1 + 1
        t0, t1 = t0 + step, t1 + step
        ends.append(t1)
    return ends[-1] - ends[-2]


@pytest.mark.parametrize("cost", [CostModel(), LARGE], ids=["default", "large"])
def test_two_stages_reach_the_best_period_of_a_brute_force(cost):
    M = 8
    chosen = compile_schedule(2, M, options=AHEAD, cost=cost)
    best = min(_two_stage_period(w, lag, M, cost) for w, lag in itertools.product(range(1, M + 1), range(1, M)))
    plain = compile_schedule(2, M, options=AHEAD.with_(ahead=False), cost=cost)
    # the brute force sends at once; the runtime's first activation leaves at the agreement, once
    # the last stage has stepped: one message's flight later
    assert period(chosen.streams, cost) == pytest.approx(best + cost.transfer, rel=1e-6)
    assert period(chosen.streams, cost) < 0.97 * period(plain.streams, cost)  # what the thread can gain
    assert best == pytest.approx(M * (cost.forward + cost.backward) + cost.step, rel=1e-3)  # no idle left


@pytest.mark.parametrize("P,M", [(2, 8), (3, 6), (4, 8)])
def test_the_order_runs_the_same_work(P, M):
    ahead = compile_schedule(P, M, options=AHEAD).streams
    plain = compile_schedule(P, M, options=AHEAD.with_(ahead=False)).streams
    assert {n: _whole(s) for n, s in ahead.items()} == {n: _whole(s) for n, s in plain.items()}
    assert ahead != plain  # another order
    assert simulate(compile_schedule(P, M, options=AHEAD)).makespan > 0  # the engine's checks pass


def _whole(stream):
    """A stream's work with split backwards counted as whole ones: the passes run."""
    kinds = {Op.BACKWARD_INPUT: Op.BACKWARD, Op.BACKWARD_WEIGHT: None}
    return sorted((kinds.get(i.op, i.op).value, i.stage, i.mb) for i in stream if kinds.get(i.op, i.op) is not None)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("P,M", [(2, 4), (3, 4)])
def test_every_failure_point_of_the_order_recovers(mode, P, M):
    options = AHEAD.with_(redundancy=mode)
    base = compile_schedule(P, M, options=options)
    for d in base.streams:
        for k in range(len(base.streams[d]) + 1):
            rec = compile_recovery(P, M, d, k, options=options)
            assert all(simulate(rec).finished.values())  # raises on any violation


@pytest.mark.parametrize("P,M", [(2, 8), (3, 6), (4, 8)])
def test_the_period_waits_for_the_agreement(P, M):
    """Run back to back with no agreement at all, stage 0's owner would send its first
    activations as soon as they exist: the period sends them once the last node has
    ended, so it is never shorter; with two stages one message's flight longer (the
    last stage asks for its first activation after its own step)."""
    streams = compile_schedule(P, M, options=AHEAD).streams
    cost = CostModel()

    def span(k):
        repeated = {n: s * k for n, s in streams.items()}
        return makespan(repeated, start_times(repeated, cost), cost)
    back_to_back = span(4) - span(3)
    assert period(streams, cost) >= back_to_back - 1e-9
    if P == 2:
        assert period(streams, cost) == pytest.approx(back_to_back + cost.transfer)
    single = makespan(streams, start_times(streams, cost), cost)
    assert period(streams, cost) <= single + 1e-9  # what runs ahead never costs time
