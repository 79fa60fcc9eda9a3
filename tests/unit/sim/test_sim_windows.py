"""The cluster simulator with `--replica-sync next` (sim/windows.py): the fault-free
iteration is off's, and a death before the owner's sync landed (or, with two
pipelines, after its reduce) is charged a rollback on one pipeline; with two or
more a failover and a transfer while another pipeline's owner of the stage lives
to lend, else a redo or a rollback."""
import json

import pytest

from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.ir import Op
from schedules.layout import ScheduleError

from agents.policy import Config
from sim.accounting import RunState
from sim.command import main
from sim.profiles import PROFILES, profile
from sim.simulator import ClusterSimulator, Options
from sim.windows import Window, stale, stage_windows
from schedules.deaths import IN_ITERATION, PEERS
from schedules.options import ScheduleOptions

BERT = PROFILES["bert-large"]
WHOLE = {"max_stages": 1, "rollback": "relaunch"}
P3 = "traces/ec2-p3-trace.csv"


def off_schedule(pipelines):
    cost = BERT.cost(2, pipelines)
    return cost, simulate(compile_schedule(2, -(-BERT.microbatches // pipelines), (), options=ScheduleOptions(redundancy="off"), cost=cost))


@pytest.mark.parametrize("pipelines", [1, 2])
def test_the_windows_are_the_sync_s_flight_and_the_time_after_the_reduce(pipelines):
    """Against off's schedule, which has no sync: the sync, sent first, lands one
    transfer into an iteration as long as off's; the reduce ends where off's does."""
    cost, off = off_schedule(pipelines)
    windows = stage_windows(BERT, 2, pipelines, "eager", "bubbles", "next")
    reduces = {s.node: s.end for s in off.spans if s.instr.op is Op.REDUCE_GRADS}
    for stage, w in enumerate(windows):
        assert w.landed == pytest.approx(cost.sync_transfer / off.makespan, rel=1e-9)
        assert w.reduced == (pytest.approx(reduces[stage] / off.makespan, rel=1e-9) if pipelines > 1 else 1.0)
    assert stage_windows(BERT, 2, pipelines, "eager", "bubbles", "end") == ()
    assert stage_windows(BERT, 2, pipelines, "off", "bubbles", "next") == ()


def test_the_recovery_compiler_refuses_the_cut_the_window_starts_with():
    """The window's first instant, an owner dead before its first instruction (the
    sync), is what schedules/recovery.py refuses; a cut after it recovers."""
    cost = BERT.cost(4, 1)
    for node in range(4):
        with pytest.raises(ScheduleError, match="a step behind"):
            compile_recovery(4, 6, node, 0, options=ScheduleOptions(redundancy="eager", sync="next"), cost=cost)
        compile_recovery(4, 6, node, 1, options=ScheduleOptions(redundancy="eager", sync="next"), cost=cost)
    assert all(w.landed > 0 for w in stage_windows(BERT, 4, 1, "eager", "bubbles", "next"))


def test_a_fault_free_iteration_costs_off_s_with_the_sync_in_the_next_one():
    gpt2 = profile("gpt2")
    for pipelines in (1, 2):
        late = ClusterSimulator(gpt2, 8, "bamboo", Options(replica_sync="next"))
        end = ClusterSimulator(gpt2, 8, "bamboo")
        off = late.iteration_seconds(pipelines, mode="off")
        # (1.0 to the float with whole backwards; split ones leave the late sync's
        # replica step fewer waits: 1.0105 at 8 stages)
        assert late.iteration_seconds(pipelines) == pytest.approx(off, rel=0.02)
        assert end.iteration_seconds(pipelines) > 1.04 * off  # the sync at the end is on the critical path


def test_stale_keeps_the_dead_stages_whose_death_fell_in_their_window_and_nobody_lends_to():
    windows = (Window(0.2, 1.0), Window(0.2, 0.9))
    assert stale(windows, [{0, 1}], 0.1) == [{0, 1}]  # one pipeline: nobody to lend
    assert stale(windows, [{0, 1}], 0.95) == [{1}]
    assert stale(windows, [{0, 1}, {1}], 0.1) == [{1}, {1}]  # stage 0: the second pipeline's owner lends
    assert stale(windows, [{0, 1}, {1}], 0.5) == [set(), set()]
    assert stale(windows, [{0, 1}, set()], 0.95) == [set(), set()]
    assert stale(windows, [{0, 1}, {1}, {0}], 0.1) == [set(), set(), set()]  # a third pipeline lends stage 1
    assert stale(windows, [{1}, {1}, {0, 1}], 0.1) == [{1}, {1}, {1}]  # stage 1 dead in all three
    assert stale((), [{0}], 0.1) == [set()]


def test_between_iterations_every_dead_stage_is_stale_whoever_lives():
    windows = (Window(0.2, 1.0), Window(0.2, 0.9))
    assert stale(windows, [{0}, set()], 0.5, between=True) == [{0}, set()]
    assert stale(windows, [{0, 1}, {1}], 0.5, between=True) == [{0, 1}, {1}]


def test_lent_are_the_window_deaths_another_pipeline_covers():
    from sim.windows import lent
    windows = (Window(0.2, 1.0), Window(0.2, 0.9))
    assert lent(windows, [{0, 1}, {1}], 0.1) == [{0}, set()]
    assert lent(windows, [{0, 1}, set()], 0.95) == [{1}, set()]
    assert lent(windows, [{0, 1}], 0.1) == [set()]
    assert lent(windows, [{0}, set()], 0.1, between=True) == [set(), set()]


def react(sync, pipelines, removed, phase):
    """One batch of deaths at `phase` of the iteration, 50 samples saved."""
    sim = ClusterSimulator(BERT, 2, "bamboo", Options(replica_sync=sync, **WHOLE))
    per = BERT.samples_per_iteration()
    s = RunState(samples=100 * per + phase * per, saved=50.0)
    nodes = [f"n{i}" for i in range(2 * pipelines)]
    config = Config(0, 2, tuple(tuple(nodes[2 * p:2 * p + 2]) for p in range(pipelines)))
    live = {n: "a" for n in nodes if n not in removed}
    sim.rules.react(sim, s, config, live, set(removed))
    return sim, s


def test_one_pipeline_rolls_back_for_a_death_in_the_window_and_fails_over_after_it():
    window = stage_windows(BERT, 2, 1, "eager", "bubbles", "next")[1]
    sim, s = react("next", 1, {"n1"}, window.landed / 2)
    assert (s.fatal, s.samples) == (1, 50.0)
    after, s = react("next", 1, {"n1"}, (window.landed + 1) / 2)
    assert s.fatal == 0 and s.redos == 0 and s.samples > 50.0  # a failover: nothing lost
    assert 0 < s.paused_until < after.opt.failure_timeout + after.iteration_seconds(1)  # cheaper than a redo
    _, s = react("end", 1, {"n1"}, window.landed / 2)  # the sync at the end: a failover anywhere
    assert s.fatal == 0 and s.redos == 0


def test_a_death_during_a_pause_comes_between_iterations():
    """A death while training stands (a failover's or reconfiguration's pause) comes
    between iterations, when every sync is owed: the stage is lost, wherever the
    samples say the iteration stood."""
    window = stage_windows(BERT, 2, 1, "eager", "bubbles", "next")[1]
    sim = ClusterSimulator(BERT, 2, "bamboo", Options(replica_sync="next", **WHOLE))
    per = BERT.samples_per_iteration()
    for paused, fatal in ((False, 0), (True, 1)):
        s = RunState(t=100.0, samples=100 * per + (window.landed + 1) / 2 * per, saved=50.0,
                     paused_until=120.0 if paused else 0.0)
        sim.rules.react(sim, s, Config(0, 2, (("n0", "n1"),)), {"n0": "a"}, {"n1"})
        assert s.fatal == fatal


def failovers(s):
    return [end - start for start, end, why in s.pauses if why == "failover"]


@pytest.mark.parametrize("place", ["before the sync landed", "after the reduce"])
def test_two_pipelines_survive_a_window_death_another_pipeline_lends_to(place):
    """Stage 1's owner of the first pipeline dies in its window while the second
    pipeline's (n3) lives: it lends the holder what it misses, and the death is
    survived in the iteration, its failover one sync transfer dearer than outside
    the window."""
    window = stage_windows(BERT, 2, 2, "eager", "bubbles", "next")[1]
    assert window.landed < window.reduced < 1.0
    phase = window.landed / 2 if place == "before the sync landed" else (window.reduced + 1) / 2
    sim, s = react("next", 2, {"n1"}, phase)
    assert (s.fatal, s.redos, s.samples > 50.0) == (0, 0, True)
    assert s.survived[IN_ITERATION] == 1 and s.survived[PEERS] == 0
    _, outside = react("next", 2, {"n1"}, (window.landed + window.reduced) / 2)
    transfer = BERT.cost(2).sync_transfer / 1000  # the stage's gradients over the network
    assert transfer > 0 and failovers(s) == [pytest.approx(failovers(outside)[0] + transfer)]
    assert failovers(outside)[0] < sim.opt.failure_timeout + sim.iteration_seconds(2)  # cheaper than a redo


def test_two_pipelines_roll_back_a_stage_stale_in_both_and_redo_one_dead_between_iterations():
    """Nobody lends where the batch took stage 1's owner in both pipelines: back to
    the checkpoint, before the sync landed or after the reduce. Between iterations
    (a death during a pause) every sync is owed: a redo, with a lender alive."""
    window = stage_windows(BERT, 2, 2, "eager", "bubbles", "next")[1]
    for phase in (window.landed / 2, (window.reduced + 1) / 2):
        _, s = react("next", 2, {"n1", "n3"}, phase)
        assert (s.fatal, s.samples) == (1, 50.0)
        _, s = react("end", 2, {"n1", "n3"}, phase)  # nodes 0 and 2 hold stage 1 current
        assert s.fatal == 0
    sim = ClusterSimulator(BERT, 2, "bamboo", Options(replica_sync="next", **WHOLE))
    per = BERT.samples_per_iteration()
    s = RunState(t=100.0, samples=100 * per + (window.landed + window.reduced) / 2 * per, saved=50.0,
                 paused_until=120.0)
    nodes = ("n0", "n1", "n2", "n3")
    sim.rules.react(sim, s, Config(0, 2, (nodes[:2], nodes[2:])), {n: "a" for n in nodes if n != "n1"}, {"n1"})
    assert (s.fatal, s.redos) == (0, 1) and s.survived[PEERS] == 1


def test_bamboo_sim_prints_the_sync_and_notes_it_where_no_replica_is_synced(capsys):
    assert main(["--trace", P3, "--hours", "2", "--stages", "4", "--replica-sync", "next"]) == 0
    assert json.loads(capsys.readouterr().out)["replica_sync"] == "next"
    assert main(["--trace", P3, "--hours", "2", "--stages", "4", "--strategy", "redo", "--replica-sync", "next"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["bamboo-sim: note: --replica-sync does nothing in this run: only Bamboo's replicas are synced "
                   "(--strategy bamboo, lazy, auto or all)"]
    with pytest.raises(SystemExit) as stop:
        main(["--trace", P3, "--replica-sync", "later"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--replica-sync" in err[0]
    with pytest.raises(ValueError, match="--replica-sync"):
        Options(replica_sync="later").check()
