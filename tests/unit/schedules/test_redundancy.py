"""Passes (c)-(e): eager FRC, swap-out, lazy BRC; and merged groups after a failure."""
import pytest

from schedules.compiler import base_streams, compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.timing.engine import validate as simulate_streams
from schedules.ir import INPUT_GRADS, WEIGHT_GRADS, Op, is_frc
from schedules.layout import Layout
from schedules.options import ScheduleOptions


def _normal_work(stream):
    """Everything but FRC, loads and the replica sync."""
    return [x for x in stream if not is_frc(x) and x.op not in (Op.SWAP_OUT, Op.LOAD, Op.SEND_SYNC, Op.RECV_SYNC)
            and not (x.op is Op.OPTIMIZER_STEP and x.redundant)]


@pytest.mark.parametrize("P,M", [(2, 1), (3, 5), (4, 8), (8, 16)])
def test_with_frc_all_every_node_runs_frc_of_its_successor_for_every_microbatch(P, M):
    sched = compile_schedule(P, M, options=ScheduleOptions(frc="all"))
    for m, stream in sched.streams.items():
        frc = [x for x in stream if is_frc(x)]
        assert [(x.stage, x.mb) for x in frc] == [((m + 1) % P, mb) for mb in range(M)]
        assert sched.frc_microbatches(m) == list(range(M))
        assert not any(x.op is Op.BACKWARD and x.redundant for x in stream)
        for i, x in enumerate(stream):  # intermediates go to host memory right away
            if is_frc(x):
                assert stream[i + 1].op is Op.SWAP_OUT and stream[i + 1][1:3] == x[1:3]


@pytest.mark.parametrize("frc", ["bubbles", "all"])
@pytest.mark.parametrize("P,M", [(3, 5), (4, 8), (8, 16)])
def test_frc_only_adds_work_to_the_plain_stream(P, M, frc):
    off, eager = compile_schedule(P, M, options=ScheduleOptions(redundancy="off")), compile_schedule(P, M, options=ScheduleOptions(frc=frc))
    for m in off.streams:
        assert _normal_work(eager.streams[m]) == _normal_work(off.streams[m])
        loads = lambda s: sorted(x.mb for x in s if x.op is Op.LOAD)  # noqa: E731
        reads_data = (m + 1) % P in (0, P - 1)  # FRC of stage 0 loads inputs, of stage P-1 labels
        frc_loads = set(eager.frc_microbatches(m)) if reads_data else set()
        assert loads(eager.streams[m]) == sorted(set(loads(off.streams[m])) | frc_loads)


@pytest.mark.parametrize("P,M", [(4, 8), (4, 32), (8, 8), (8, 32), (5, 7)])
def test_frc_all_costs_no_more_than_its_leftover(P, M):
    """Lower bound: no node finishes before its own work is done. Upper bound: FRC
    that fits in a wait delays nothing, the rest only delays its own node. Both
    against the same streams with replica syncs but no FRC."""
    cost = CostModel()
    layout = Layout(P)
    plain = simulate_streams(layout, M, base_streams(layout, M, ScheduleOptions(), cost), cost, expect_frc=False)
    r_eager = simulate(compile_schedule(P, M, options=ScheduleOptions(frc="all")), cost)
    frc_work = {m: sum(cost.duration(x) for x in s if is_frc(x) or x.op is Op.SWAP_OUT)
                for m, s in compile_schedule(P, M, options=ScheduleOptions(frc="all")).streams.items()}
    lower = max([plain.makespan] + [plain.busy[m] + frc_work[m] for m in frc_work])
    assert lower - 1e-9 <= r_eager.makespan <= plain.makespan + max(frc_work.values()) + 1e-9


def test_frc_fits_entirely_in_bubbles_of_a_deep_short_pipeline():
    """(Whole backwards: split ones fill the bubbles with weight passes.)"""
    cost = CostModel()
    layout = Layout(8)
    plain = simulate_streams(layout, 8, base_streams(layout, 8, ScheduleOptions(split="off"), cost), cost, expect_frc=False)
    for frc in ("all", "bubbles"):
        sched = compile_schedule(8, 8, options=ScheduleOptions(frc=frc, split="off"))
        assert simulate(sched, cost).makespan == pytest.approx(plain.makespan)
        assert all(sched.frc_microbatches(m) == list(range(8)) for m in sched.streams)


def test_lazy_brc_swaps_in_then_backward_for_every_microbatch():
    sched = compile_schedule(3, 2, options=ScheduleOptions(frc="all"))
    assert [str(x) for x in sched.lazy_brc(2)] == [
        "swap_in s0 mb0", "backward s0 mb0 (R)", "swap_in s0 mb1", "backward s0 mb1 (R)"]
    assert compile_schedule(3, 2, failed=(2,)).lazy_brc(1) == []  # its successor is gone


def test_lazy_brc_recomputes_the_forwards_whose_frc_did_not_fit():
    # node 0's first wait (2.1) holds the replica's owed step (0.1) and one FRC of stage 1
    # with its swap (1.05); a second would need 1.05 more
    sched = compile_schedule(2, 6, options=ScheduleOptions(split="off"))
    assert sched.frc_microbatches(0) == [0]
    assert [str(x) for x in sched.lazy_brc(0)[:6]] == [
        "swap_in s1 mb0", "backward s1 mb0 (R)", "forward s1 mb1 (R)", "backward s1 mb1 (R)",
        "forward s1 mb2 (R)", "backward s1 mb2 (R)"]
    # without the owed step (a step free of cost) both fit, as before the step was owed
    assert compile_schedule(2, 6, options=ScheduleOptions(split="off"), cost=CostModel(step=0.0)).frc_microbatches(0) == [0, 1]
    # nor is one owed in a run's first iteration with the sync in the next (sync "none")
    assert compile_schedule(2, 6, options=ScheduleOptions(split="off", sync="none")).frc_microbatches(0) == [0, 1]


@pytest.mark.parametrize("P,M,failed", [(4, 6, (2,)), (4, 3, (0,)), (6, 5, (1, 4)), (2, 3, (1,)), (2, 2, (0,))])
def test_failed_nodes_stages_run_as_normal_work_on_the_predecessor(P, M, failed):
    sched = compile_schedule(P, M, failed=failed)
    assert set(sched.streams) == set(range(P)) - set(failed)
    for d in failed:
        p = (d - 1) % P
        stream = sched.streams[p]
        for stage in (p, d):
            for ops in ({Op.FORWARD}, INPUT_GRADS, WEIGHT_GRADS):  # a backward whole, or split in two
                assert sorted(x.mb for x in stream if x.op in ops and x.stage == stage and not x.redundant) \
                    == list(range(M))
        assert not any(x.peer == d for x in stream)
        assert not any(is_frc(x) for x in stream)  # p holds no replica any more
    simulate(sched)


@pytest.mark.parametrize("P,M", [(2, 3), (4, 8), (5, 7)])
def test_lazy_runs_no_frc_but_keeps_and_syncs_the_replica(P, M):
    """Lazy: the plain streams plus the replica's sync and step, nothing redundant
    before a failure; after one, the predecessor recomputes the dead stage's
    forward (FRC) and backward (BRC) for every microbatch whose gradients died."""
    off, lazy = compile_schedule(P, M, options=ScheduleOptions(redundancy="off")), compile_schedule(P, M, options=ScheduleOptions(redundancy="lazy"))
    for m in off.streams:
        assert not any(is_frc(x) or x.op in (Op.SWAP_OUT, Op.SWAP_IN) for x in lazy.streams[m])
        assert _normal_work(lazy.streams[m]) == _normal_work(off.streams[m])
        assert [(x.op, x.stage) for x in lazy.streams[m] if x.redundant or x.op in (Op.SEND_SYNC, Op.RECV_SYNC)] \
            == [(Op.SEND_SYNC, m), (Op.RECV_SYNC, (m + 1) % P), (Op.OPTIMIZER_STEP, (m + 1) % P)]
    rec = compile_recovery(P, M, 1, 0, options=ScheduleOptions(redundancy="lazy"))
    simulate(rec)
    brc = [(x.op, x.mb) for x in rec.streams[0] if x.stage == 1 and x.op in (Op.FORWARD, Op.BACKWARD)]
    assert sorted(brc) == sorted([(Op.FORWARD, mb) for mb in range(M)] + [(Op.BACKWARD, mb) for mb in range(M)])


@pytest.mark.parametrize("mode,frc", [("eager", "all"), ("eager", "bubbles"), ("lazy", "bubbles")])
def test_the_sync_leaves_before_its_owner_steps(mode, frc):
    """The owner sends its reduced gradients to the replica's holder before its own
    step, so that the two steps overlap. With lazy or bounded eager, where the
    syncs end the iteration, the simulator's iteration is shorter than with each
    sync after its owner's step (the tail's order before); --frc all's leftover
    FRC hides either."""
    P, M = 4, 8
    sched = compile_schedule(P, M, options=ScheduleOptions(redundancy=mode, frc=frc))
    late = {}
    for m, stream in sched.streams.items():
        own = [(x.op, x.stage) for x in stream if x.op in (Op.SEND_SYNC, Op.OPTIMIZER_STEP) and not x.redundant]
        assert own == [(Op.SEND_SYNC, m), (Op.OPTIMIZER_STEP, m)]
        rest = [x for x in stream if x.op is not Op.SEND_SYNC]
        step = next(i for i, x in enumerate(rest) if x.op is Op.OPTIMIZER_STEP and not x.redundant)
        late[m] = rest[:step + 1] + [x for x in stream if x.op is Op.SEND_SYNC] + rest[step + 1:]
    before = simulate_streams(Layout(P), M, late, expect_frc=frc == "all" and mode == "eager").makespan
    assert simulate(sched).makespan < before if frc == "bubbles" else simulate(sched).makespan <= before
