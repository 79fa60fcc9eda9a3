"""Eager FRC bounded by the bubbles (--frc bubbles): FRC only where the node idles.

The references are independent of the placement: lazy's streams (the same
streams, no FRC) run through the validating simulator, a brute force that adds
the placed FRC one at a time, and the placement the compiler had before
(--frc all, pinned from that code)."""
import pytest

from schedules.timing.bubbles import check_in_bubbles
from schedules.timing.checks import ValidationError
from schedules.compiler import base_streams, compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.timing.engine import Engine
from schedules.ir import Op, is_frc
from schedules.layout import Layout
from sim.profiles import profile
from schedules.options import ScheduleOptions

UNEVEN = CostModel(forward=(0.5, 2.0, 1.0), backward=(1.0, 4.0, 0.5), transfer=0.7, swap=0.3)
# GPT-2 XL's calibrated costs at P=12, one pipeline: a swap-out takes three forwards
GPT2 = profile("gpt2", "calibrated").cost(12, 1)


def _starts(report, node):
    return {span.instr: span.start for span in report.spans if span.node == node}


def _replica_end(ins):
    return ins.op is Op.RECV_SYNC or (ins.op is Op.OPTIMIZER_STEP and ins.redundant)


def _delays(layout, M, streams, cost, without):
    """(node, instruction) pairs that start later in `streams` than in `without`
    (lazy's report), bar the replica's sync and step; and the makespan."""
    report = Engine(layout, M, cost, expect_frc=False).run(streams)
    late = [(n, ins) for n in streams for ins, t in _starts(report, n).items()
            if ins in _starts(without, n) and not _replica_end(ins) and t > _starts(without, n)[ins] + 1e-9]
    return late, report.makespan


@pytest.mark.parametrize("P,M,failed,cost", [
    (2, 6, (), CostModel()), (4, 8, (), CostModel()), (4, 32, (), CostModel()), (8, 16, (), CostModel()),
    (6, 12, (2,), CostModel()), (3, 9, (), UNEVEN), (12, 24, (), GPT2), (12, 12, (5,), GPT2)])
def test_bounded_frc_leaves_the_iteration_as_long_as_without_it(P, M, failed, cost):
    eager = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy="eager"), cost=cost)
    lazy = simulate(compile_schedule(P, M, failed, options=ScheduleOptions(redundancy="lazy"), cost=cost))
    late, makespan = _delays(eager.layout, M, eager.streams, cost, lazy)
    assert late == [] and makespan == pytest.approx(lazy.makespan, rel=1e-12)
    assert simulate(eager).makespan == pytest.approx(lazy.makespan, rel=1e-12)  # the validator agrees
    for node, stream in eager.streams.items():  # the stream says which microbatches have FRC: a prefix
        frc = [i.mb for i in stream if is_frc(i)]
        assert frc == eager.frc_microbatches(node) == list(range(len(frc)))


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("cost", [CostModel(), CostModel(forward=1.0, backward=1.0, transfer=0.5, swap=0.8)])
def test_no_frc_placed_lengthens_the_critical_path_brute_force(P, cost):
    """Every FRC the compiler placed, added alone to lazy's streams, delays no
    instruction and leaves the makespan; so do all of them together."""
    for M in range(1, 7):
        eager = compile_schedule(P, M, cost=cost)
        lazy = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy="lazy"), cost=cost))
        placed = [(n, i) for n, s in eager.streams.items() for i, x in enumerate(s) if is_frc(x)]
        for node, at in placed + [(None, None)]:
            streams = {n: [x for i, x in enumerate(s) if (n, i) == (node, at) or node is None
                           or not (is_frc(x) or x.op is Op.SWAP_OUT)
                           or ((n, i - 1) == (node, at) and x.op is Op.SWAP_OUT)]
                       for n, s in eager.streams.items()}
            late, makespan = _delays(eager.layout, M, streams, cost, lazy)
            assert late == [] and makespan <= lazy.makespan + 1e-9, (M, node, at)


def test_the_brute_force_finds_the_frc_that_frc_all_puts_where_it_does_not_fit():
    """The check above is not vacuous: --frc all's leftover FRC lengthens the iteration."""
    eager = compile_schedule(4, 16, options=ScheduleOptions(frc="all"))
    lazy = simulate(compile_schedule(4, 16, options=ScheduleOptions(redundancy="lazy")))
    late, makespan = _delays(eager.layout, 16, eager.streams, CostModel(), lazy)
    assert makespan > lazy.makespan + 1
    with pytest.raises(ValidationError) as e:
        check_in_bubbles(base_streams(eager.layout, 16, ScheduleOptions(), CostModel()), eager.streams, CostModel())
    assert e.value.kind == "frc-delay" and "lengthens" in str(e.value)


def test_an_frc_moved_into_a_wait_too_short_is_refused():
    eager = compile_schedule(4, 8)
    streams = {n: list(s) for n, s in eager.streams.items()}
    s = streams[1]
    at = next(i for i, x in enumerate(s) if is_frc(x) and x.mb == 0)
    frc = s[at:at + 2]
    del s[at:at + 2]
    after = next(i for i, x in enumerate(s) if x.op is Op.SEND_ACT and x.mb == 0) + 1
    s[after:after] = frc  # right after node 1 sent mb 0 on: it has its next activation to work on
    with pytest.raises(ValidationError) as e:
        check_in_bubbles(base_streams(eager.layout, 8, ScheduleOptions(), CostModel()), streams, CostModel())
    assert e.value.kind == "frc-delay" and "node 1" in str(e.value)


# Where the compiler put each FRC before bounded eager (commit 9029ca4): index in the node's stream
OLD_FRC = {(4, 8, "default"): {0: [12, 14, 16, 18, 44, 48, 55, 57], 1: [9, 11, 13, 48, 53, 61, 63, 65],
                               2: [7, 10, 52, 61, 64, 67, 70, 73], 3: [1, 4, 7, 49, 51, 53, 55, 57]},
           (3, 5, "uneven"): {0: [9, 11, 13, 20, 27], 1: [34, 37, 40, 43, 46], 2: [1, 4, 7, 10, 21]}}


@pytest.mark.parametrize("P,M,name", list(OLD_FRC))
def test_frc_all_is_the_placement_of_before(P, M, name):
    sched = compile_schedule(P, M, options=ScheduleOptions(frc="all", split="off"), cost={"default": CostModel(), "uneven": UNEVEN}[name])
    assert {n: [i for i, x in enumerate(s) if is_frc(x)] for n, s in sched.streams.items()} == OLD_FRC[(P, M, name)]
    simulate(sched)


@pytest.mark.parametrize("split,held", [("off", 6), ("last", 2)])
def test_a_death_uses_the_frc_that_ran_and_recomputes_the_rest(split, held):
    """Node 2 dies at every point of its stream; its holder, node 1, has FRC of
    stage 2 for microbatches 0..5 of 8 in its bubbles (0 and 1 with its backwards
    split, whose weight passes take waits). The recovery validates, swaps in only
    what ran before the cut, and recomputes every other forward (among them those
    no bubble held) exactly once."""
    P, M, d, p = 4, 8, 2, 1
    base = compile_schedule(P, M, options=ScheduleOptions(split=split))
    assert base.frc_microbatches(p) == list(range(held))
    mixed = 0
    for k in range(len(base.streams[d]) + 1):
        rec = compile_recovery(P, M, d, k, options=ScheduleOptions(split=split))
        assert all(simulate(rec).finished.values())
        prefix, part = rec.streams[p][:rec.resume_at[p]], rec.streams[p][rec.resume_at[p]:]
        if not any(x.op is Op.BACKWARD and x.stage == d for x in part):
            continue  # d died after its replica was synced: nothing to recompute
        ran = {x.mb for x in prefix if is_frc(x) and x.stage == d}
        recomputed = [x.mb for x in part if x.op is Op.FORWARD and x.stage == d]
        swapped = {x.mb for x in part if x.op is Op.SWAP_IN and x.stage == d}
        assert sorted(recomputed) == sorted(set(range(M)) - ran) and swapped <= ran
        assert sorted(x.mb for x in part if x.op is Op.BACKWARD and x.stage == d) == list(range(M))
        mixed += bool(swapped) and {6, 7} <= set(recomputed)
    assert mixed > 10


def test_the_replica_step_may_take_the_idle_end_of_a_node():
    """A node that ends before the iteration does may run FRC after its own step,
    before its replica's sync: nothing waits for that sync, so the iteration ends
    as without FRC, and the node covers more microbatches than its waits hold.
    (Whole backwards: split ones take those waits, tests/integration/test_early_grads.py.)"""
    layout = Layout(8)
    eager = compile_schedule(8, 8, options=ScheduleOptions(split="off"))
    late_tail = [n for n, s in eager.streams.items()
                 if any(is_frc(x) for x in s[next(i for i, x in enumerate(s) if x.op is Op.REDUCE_GRADS):])]
    assert late_tail and all(eager.frc_microbatches(n) == list(range(8)) for n in eager.streams)
    length, with_frc = check_in_bubbles(base_streams(layout, 8, ScheduleOptions(split="off"), CostModel()), eager.streams,
                                        CostModel())
    assert with_frc == pytest.approx(length)
