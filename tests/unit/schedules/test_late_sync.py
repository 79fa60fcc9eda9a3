"""`--replica-sync next` (schedules/syncs.py): each replica's sync of iteration i
travels in iteration i+1's streams. Checked against independent references: the
iteration without redundancy (the sync off the critical path costs nothing that
off does not), the end-of-iteration sync's cost (the sync's flight time, on that
path), and every failure point of small pipelines through the validating simulator."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.timing.checks import ValidationError
from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.timing.engine import Engine
from schedules.ir import Instr, Op
from schedules.layout import ScheduleError
from schedules.syncs import sync_landed_first

from tests.unit.schedules.test_properties import costs, layouts
from schedules.options import ScheduleOptions


@pytest.mark.parametrize("redundancy", ["lazy", "eager"])
@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_a_long_sync_leaves_the_critical_path(redundancy, P):
    """A sync that flies 20 forwards long: at the iteration's end it adds its flight
    to the iteration (the holder of stage 0 waits for node 0, the last to finish);
    in the next iteration it lands while the holders work, and the iteration is the
    one without redundancy, to the float (with whole backwards; with the last ones
    split, node P-1's weight pass can leave its replica step at the very end)."""
    cost = CostModel(sync_transfer=20.0)
    off = simulate(compile_schedule(P, 8, (), options=ScheduleOptions(redundancy="off", split="off"), cost=cost)).makespan
    end = simulate(compile_schedule(P, 8, (), options=ScheduleOptions(redundancy=redundancy, split="off"), cost=cost)).makespan
    late = simulate(compile_schedule(P, 8, (), options=ScheduleOptions(redundancy=redundancy, sync="next", split="off"), cost=cost)).makespan
    assert end >= off + 20.0
    assert late == pytest.approx(off, rel=1e-12)
    off_split = simulate(compile_schedule(P, 8, (), options=ScheduleOptions(redundancy="off"), cost=cost)).makespan
    late_split = simulate(compile_schedule(P, 8, (), options=ScheduleOptions(redundancy=redundancy, sync="next"), cost=cost)).makespan
    assert late_split <= off_split + cost.step + 1e-9 and late_split < off


def test_each_owner_sends_first_and_each_holder_steps_its_replica_before_its_frc():
    sched = compile_schedule(4, 8, (), options=ScheduleOptions(redundancy="eager", sync="next"), cost=CostModel(sync_transfer=3.0))
    for node, stream in sched.streams.items():
        replica = sched.layout.replica(node)
        assert stream[0] == Instr(Op.SEND_SYNC, node, peer=sched.layout.holder(node))
        recv = stream.index(Instr(Op.RECV_SYNC, replica, peer=sched.layout.owner(replica)))
        assert stream[recv + 1] == Instr(Op.OPTIMIZER_STEP, replica, redundant=True)
        assert sync_landed_first(stream, replica) and sched.frc_microbatches(node)
    assert sched.to_json()["replica_sync"] == "next"


def test_the_validator_refuses_frc_before_the_sync_landed():
    """The same stream with the replica's sync and step moved after its first FRC."""
    sched = compile_schedule(3, 4, (), options=ScheduleOptions(redundancy="eager", sync="next"))
    node = next(n for n in sched.streams if sched.frc_microbatches(n))
    stream = list(sched.streams[node])
    recv = next(i for i, x in enumerate(stream) if x.op is Op.RECV_SYNC)
    sync = stream[recv:recv + 2]
    del stream[recv:recv + 2]
    first_frc = next(i for i, x in enumerate(stream) if x.op is Op.FORWARD and x.redundant)
    stream[first_frc + 2:first_frc + 2] = sync
    assert not sync_landed_first(stream, sched.layout.replica(node))
    with pytest.raises(ValidationError, match="computed on its replica before it took the sync of the iteration"):
        Engine(sched.layout, 4, sched.cost, late_sync=True).run({**sched.streams, node: stream})


@pytest.mark.parametrize("P,M,failed,redundancy", [(2, 3, (), "lazy"), (3, 4, (), "eager"), (4, 5, (), "eager"),
                                                   (4, 4, (), "lazy"), (5, 4, (2,), "eager"), (6, 3, (1, 4), "lazy")])
def test_every_failure_point_recovers_or_is_refused_for_a_sync_in_flight(P, M, failed, redundancy):
    """A death of an owner whose sync of the iteration before had not arrived is
    refused (its holder's replica is a step behind); every other cut recovers and
    validates, each survivor's stream beginning with what it was told to run."""
    cost = CostModel(sync_transfer=2.0)
    base = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy=redundancy, sync="next"), cost=cost)
    for d, stream in base.streams.items():
        if (d - 1) % P in failed or (d + 1) % P in failed:
            continue
        sync_at = next(i for i, x in enumerate(stream) if x.op is Op.SEND_SYNC and x.peer == base.layout.holder(d))
        for k in range(len(stream) + 1):
            if k <= sync_at:
                with pytest.raises(ScheduleError, match="a step behind"):
                    compile_recovery(P, M, d, k, failed, options=ScheduleOptions(redundancy=redundancy, sync="next"), cost=cost)
                continue
            rec = compile_recovery(P, M, d, k, failed, options=ScheduleOptions(redundancy=redundancy, sync="next"), cost=cost)
            report = simulate(rec)
            assert all(report.finished.values())
            p = base.layout.holder(d)
            stream_p = rec.streams[p]
            step = stream_p.index(Instr(Op.OPTIMIZER_STEP, d, redundant=True))  # the late sync's, taken once
            computed = [i for i, x in enumerate(stream_p) if x.stage == d and x.op in (Op.FORWARD, Op.BACKWARD)]
            assert computed and step < computed[0]  # the stage runs on its replica only once it is current
            assert (d, False) in {(x.stage, x.redundant) for x in stream_p if x.op is Op.OPTIMIZER_STEP}
            for n, s in rec.streams.items():
                assert s[:rec.resume_at[n]] == base.streams[n][:rec.resume_at[n]]


@settings(max_examples=40)  # 150 took 36 s of make test
@given(layouts(), st.sampled_from(["1f1b", "gpipe"]), costs, st.sampled_from(["eager", "lazy"]), st.data())
def test_any_layout_and_cost_compiles_validates_and_recovers(layout, order, cost, redundancy, data):
    """The property test of test_properties.py, with the sync in the next iteration:
    never longer than the sync at the end, and every cut recovers or is refused."""
    P, M, failed = layout
    late = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy=redundancy, order=order, sync="next"), cost=cost)
    end = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy=redundancy, order=order), cost=cost)
    assert simulate(late).makespan <= simulate(end).makespan * (1 + 1e-9) + 1e-9
    candidates = [d for d in late.streams if (d - 1) % P not in failed and (d + 1) % P not in failed]
    if not candidates:
        return
    d = data.draw(st.sampled_from(candidates))
    k = data.draw(st.integers(0, len(late.streams[d])))
    try:
        rec = compile_recovery(P, M, d, k, failed, options=ScheduleOptions(redundancy=redundancy, order=order, sync="next"), cost=cost)
    except ScheduleError as e:
        assert "a step behind" in str(e)
        return
    assert all(simulate(rec).finished.values())


@pytest.mark.parametrize("redundancy", ["lazy", "eager"])
def test_a_first_iteration_owes_no_sync_and_every_cut_recovers(redundancy):
    """The first iteration of a run (or an epoch) with late syncs: none in the
    streams, the replicas whole, so every death is survivable as at the end."""
    sched = compile_schedule(4, 4, (), options=ScheduleOptions(redundancy=redundancy, sync="none"))
    assert not any(i.op in (Op.SEND_SYNC, Op.RECV_SYNC) for s in sched.streams.values() for i in s)
    assert simulate(sched).makespan == pytest.approx(simulate(compile_schedule(4, 4, (), options=ScheduleOptions(redundancy="off"))).makespan)
    for d, stream in sched.streams.items():
        for k in range(len(stream) + 1):
            assert all(simulate(compile_recovery(4, 4, d, k, (), options=ScheduleOptions(redundancy=redundancy, sync="none"))).finished.values())


def test_the_validator_refuses_a_recovery_whose_new_owner_only_steps_the_replica():
    """With late syncs the holder's replica step is the iteration before's: the stage
    taken over must still be reduced and stepped as its own (with `end`, a replica
    synced and stepped in the iteration stands for it)."""
    base = compile_schedule(3, 4, (), options=ScheduleOptions(redundancy="lazy", sync="next"))
    rec = compile_recovery(3, 4, 1, 5, (), options=ScheduleOptions(redundancy="lazy", sync="next"))
    p = 0
    own_step = Instr(Op.OPTIMIZER_STEP, 1)
    assert own_step in rec.streams[p]
    streams = {**rec.streams, p: [x for x in rec.streams[p] if x != own_step], 1: base.streams[1][:5]}
    with pytest.raises(ValidationError, match="stage 1 never stepped on its owner, node 0"):
        Engine(rec.layout, 4, rec.cost, dead=(1, 5), expect_frc=False, late_sync=True).run(streams)


def _engine_makespan(sched, streams) -> float:
    return Engine(sched.layout, sched.microbatches, sched.cost, expect_frc=False, late_sync=True).run(streams).makespan


def _pairs_at_the_end(streams):
    """Each holder's receive of its sync and replica step moved to its stream's end."""
    out = {}
    for node, stream in streams.items():
        at = [i for i, x in enumerate(stream) if x.op is Op.RECV_SYNC]
        out[node] = stream if not at else stream[:at[0]] + stream[at[0] + 2:] + stream[at[0]:at[0] + 2]
    return out


@settings(max_examples=40, deadline=None)
@given(layouts(), costs, st.sampled_from(["off", "last"]))
def test_a_replica_step_is_placed_no_worse_than_at_the_end(layout, cost, split):
    """Against the placement that needs no search (every replica step at the end of
    its holder's stream, where nobody waits for it but the iteration's end)."""
    P, M, failed = layout
    sched = compile_schedule(P, M, failed, options=ScheduleOptions(redundancy="lazy", sync="next", split=split), cost=cost)
    assert _engine_makespan(sched, sched.streams) <= _engine_makespan(sched, _pairs_at_the_end(sched.streams)) * (1 + 1e-9) + 1e-9


# gpt2's calibrated model at P=6 of 4 pipelines (sim/profiles.py): a replica step
# (35 ms) longer than each wait of 1F1B's steady phase (27 ms)
GPT2_P6 = CostModel(forward=27.09, backward=56.32, transfer=6.55, swap=89.22, reduce=737.28, step=35.18,
                    sync_transfer=491.52)


@pytest.mark.parametrize("redundancy", ["lazy", "eager"])
def test_a_replica_step_longer_than_every_wait_still_delays_nothing(redundancy):
    """The step fits no single wait after the sync lands, on any node (checked on
    the iteration without redundancy), yet the iteration is as long as without
    redundancy: the delay is made up in the waits after it, on the node or its peers.
    With every step at the end it would be one step longer."""
    off = simulate(compile_schedule(6, 6, (), options=ScheduleOptions(redundancy="off"), cost=GPT2_P6))
    for node in range(6):
        spans = sorted((s for s in off.spans if s.node == node), key=lambda s: s.start)
        gaps = [b.start - a.end for a, b in zip(spans, spans[1:]) if a.end >= GPT2_P6.sync_transfer]
        assert max(gaps, default=0.0) < GPT2_P6.step
    sched = compile_schedule(6, 6, (), options=ScheduleOptions(redundancy=redundancy, sync="next"), cost=GPT2_P6)
    assert simulate(sched).makespan == pytest.approx(off.makespan, rel=1e-12)
    lazy = compile_schedule(6, 6, (), options=ScheduleOptions(redundancy="lazy", sync="next"), cost=GPT2_P6)
    assert _engine_makespan(lazy, _pairs_at_the_end(lazy.streams)) >= off.makespan + GPT2_P6.step - 1e-9
