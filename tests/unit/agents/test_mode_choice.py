"""`agents.modes`: the pure choice of --redundancy auto against a brute force of
expected seconds per iteration, the observation of rates and times against hand
computations, and the simulator's priors against the compiled schedules."""
import itertools
import random

import pytest

from schedules.compiler import compile_schedule, simulate

from agents.modes import MARGIN, MODES, ModeStats, choose, estimates, observe, simulated
from schedules.options import ScheduleOptions


def brute_force(current, rate, nodes, pipelines, seconds, pause, rollback=None):
    """Expected seconds of every allowed mode, one death at a time: an iteration of
    t seconds on n nodes at r deaths per node-hour sees r n t / 3600 deaths. Off on
    one pipeline goes back to the checkpoint: allowed only with a `rollback` cost."""
    cost = {}
    for m in MODES:
        each = pause[m]
        if m == "off" and pipelines < 2:
            if rollback is None:
                continue
            each = rollback
        deaths = rate * nodes * seconds[m] / 3600
        cost[m] = seconds[m] + deaths * each
    best = min(cost.values())
    if current in cost and best >= cost[current] * (1 - MARGIN):
        return {current}
    return {m for m, c in cost.items() if c == best}


def test_choose_agrees_with_a_brute_force():
    rng = random.Random(5)
    for _ in range(2000):
        seconds = {m: rng.uniform(0.5, 2.0) for m in MODES}
        pause = {m: rng.uniform(0.0, 60.0) for m in MODES}
        rate, nodes, pipelines = rng.choice([0, 0.1, 10, 1e3, 1e5]), rng.randint(2, 64), rng.randint(1, 4)
        current = rng.choice(MODES + ("",))
        rollback = rng.choice([None, rng.uniform(0.0, 600.0)])
        assert choose(current, rate, nodes, pipelines, seconds, pause, rollback) in \
            brute_force(current, rate, nodes, pipelines, seconds, pause, rollback)


def test_no_preemptions_pick_the_cheapest_iteration_and_many_the_cheapest_death():
    seconds, pause = {"eager": 1.3, "lazy": 1.05, "off": 1.0}, {"eager": 0.2, "lazy": 0.6, "off": 30.0}
    assert choose("", 0.0, 16, 2, seconds, pause) == "off"
    assert choose("", 0.0, 16, 1, seconds, pause) == "lazy"  # off needs a peer pipeline
    assert choose("", 0.0, 16, 1, seconds, pause, rollback=100.0) == "off"  # or a checkpoint to go back to
    assert choose("", 10.0, 16, 1, seconds, pause, rollback=100.0) == "lazy"  # which costs too much here
    assert choose("", 0.1, 16, 2, seconds, pause, rollback=1e9) == "off"  # a peer: a redo, no rollback
    assert choose("", 1e4, 16, 2, seconds, pause) == "eager"
    assert choose("lazy", 0.0, 16, 2, seconds, pause) == "lazy"  # off saves under 5%: not worth a switch


def test_observe_weighs_deaths_per_node_hour_and_separates_times_from_pauses():
    s = observe(ModeStats(), now=1000.0, nodes=4, dead=0, mode="off", disturbed=False)
    assert s.time == 1000.0 and s.node_hours == 0  # the first iteration only starts the clock
    s = observe(s, 1002.0, 4, 0, "off", False)
    assert s.seconds == {"off": 2.0} and s.node_hours == pytest.approx(4 * 2 / 3600 * 1, rel=1e-9)
    s = observe(s, 1007.0, 4, 1, "off", True)  # a death: 5 s where 2 were usual
    assert s.pause == {"off": 3.0} and s.seconds == {"off": 2.0} and s.deaths == pytest.approx(1.0, rel=1e-3)
    assert s.rate(0.0, 1e-9) == pytest.approx(1.0 / s.node_hours, rel=1e-6)
    later = observe(s, 1007.0 + 3600, 4, 1, "off", True)  # an hour later the old death weighs half
    assert later.deaths == pytest.approx(s.deaths / 2, rel=1e-9)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8)])
def test_priors_are_the_simulated_schedules(stages, microbatches):
    times, pauses = simulated(stages, microbatches)
    off = simulate(compile_schedule(stages, microbatches, (), options=ScheduleOptions(redundancy="off"))).makespan
    for mode in ("eager", "lazy"):
        assert times[mode] == pytest.approx(simulate(compile_schedule(stages, microbatches, (), options=ScheduleOptions(redundancy=mode))).makespan / off)
    assert times["off"] == 1.0 and all(p >= 0 for p in pauses.values())
    seconds, pause = estimates(ModeStats(seconds={"lazy": 3.0}), stages, microbatches)
    assert seconds["lazy"] == 3.0 and seconds["eager"] == pytest.approx(3.0 * times["eager"] / times["lazy"])
    assert set(itertools.chain(seconds, pause)) == set(MODES)


def test_off_on_one_pipeline_is_weighed_with_the_rollback_its_checkpoints_allow():
    """The agents' rollback cost (the simulator's auto weighs one alike): a redo's
    pause and half an interval's work; with no checkpoint, off needs a peer pipeline."""
    from agents.modes import rollback_cost
    seconds, pause = {"eager": 1.3, "lazy": 1.05, "off": 1.0}, {"eager": 0.5, "lazy": 1.0, "off": 1.5}
    assert rollback_cost(10, 0, seconds, pause) == pytest.approx(1.5 + 5 * 1.0)
    assert rollback_cost(0, 60.0, seconds, pause) == pytest.approx(1.5 + 30.0)
    assert rollback_cost(0, 0, seconds, pause) is None
    cheap = rollback_cost(4, 0, seconds, pause)
    assert choose("", 0.01, 4, 1, seconds, pause, cheap) == "off"  # rare deaths: the rollback is worth risking
    assert choose("", 50.0, 4, 1, seconds, pause, cheap) != "off"  # frequent ones: a replica pays


def test_a_late_sync_charges_a_rollback_to_the_deaths_in_its_window():
    """With --replica-sync next the simulated iterations are the late-sync schedules',
    and a simulated death of eager or lazy costs, in the window's share of deaths
    (before the owner's sync of the iteration before has landed), the rollback; a
    measured pause stays what was measured."""
    from agents.modes import window_share
    from sim.windows import mean_share, stage_windows
    late, _ = simulated(4, 8, "next")
    assert late["eager"] == pytest.approx(
        simulate(compile_schedule(4, 8, (), options=ScheduleOptions(redundancy="eager", sync="next"))).makespan
        / simulate(compile_schedule(4, 8, (), options=ScheduleOptions(redundancy="off"))).makespan)
    share = window_share(4, 8)
    # the cluster simulator's windows of the same schedule (one pipeline, the default cost model)
    assert share == pytest.approx(mean_share(stage_windows(Eight(), 4, 1, "eager", "bubbles", "next")), rel=1e-9)
    _, plain = estimates(ModeStats(seconds={"off": 2.0}), 4, 8, ("next",))
    _, charged = estimates(ModeStats(seconds={"off": 2.0}, pause={"lazy+next": 1.0}), 4, 8, ("next",),
                           lambda s, p: 100.0)
    assert charged["eager+next"] == pytest.approx((1 - share) * plain["eager+next"] + share * 100.0)
    assert charged["lazy+next"] == 1.0 and charged["off"] == plain["off"]
    _, at_end = estimates(ModeStats(seconds={"off": 2.0}), 4, 8, ("end",), lambda s, p: 100.0)
    assert at_end["eager"] == pytest.approx(estimates(ModeStats(seconds={"off": 2.0}), 4, 8)[1]["eager"])


class Eight:
    """A stand-in profile for sim.windows: 8 microbatches on the default cost model."""
    microbatches = 8


def test_with_two_pipelines_a_death_in_a_window_is_lent_to_and_the_window_grows_by_the_reduce():
    """Two pipelines: a stage's window also covers the time after its owner's reduce,
    as the cluster simulator's does (each pipeline runs 4 of the 8 microbatches), but
    a death in it borrows from another pipeline's owner of the stage (taken to be
    alive): no redo, no rollback, its failover as simulated."""
    from agents.modes import window_share
    from sim.windows import mean_share, stage_windows
    share = window_share(4, 4, 2)
    assert share == pytest.approx(mean_share(stage_windows(Eight(), 4, 2, "eager", "bubbles", "next")), rel=1e-9)
    assert share > window_share(4, 4, 1)
    stats = ModeStats(seconds={"off": 2.0})
    _, plain = estimates(stats, 4, 4, ("next",))
    _, charged = estimates(stats, 4, 4, ("next",), lambda s, p: 100.0, pipelines=2)
    assert charged == plain and charged["eager+next"] < charged["off"] < 100.0


def test_a_late_setting_s_pause_is_raised_by_the_window_on_one_pipeline_only():
    """The same job's late settings on one pipeline and on two: on one a death in the
    window rolls back (its pause raised); on two it is lent to (not raised)."""
    from agents.modes import job_estimates
    from bamboo.control.config import JobConfig
    cfg = JobConfig.of(stages=4, microbatches=8, replica_sync="auto", redundancy="auto", checkpoint="/tmp/ck",
                       checkpoint_every=4)
    stats = ModeStats(seconds={"off": 2.0})
    for pipelines, microbatches in ((1, 8), (2, 4)):
        _, plain = estimates(stats, 4, microbatches, ("end", "next"))
        _, pause, rollback = job_estimates(cfg, stats, 4, pipelines)
        assert rollback > pause["eager"] and pause["eager"] == plain["eager"]
        for name in ("eager+next", "lazy+next"):
            assert (pause[name] > plain[name]) == (pipelines == 1), (pipelines, name)
            assert pause[name] >= plain[name]


def test_a_job_with_the_sync_next_and_checkpoints_gets_its_rollback_charged():
    from agents.modes import job_estimates, rollback_cost, window_share
    from bamboo.control.config import JobConfig
    cfg = JobConfig.of(stages=4, microbatches=8, replica_sync="next", redundancy="auto", checkpoint="/tmp/ck",
                       checkpoint_every=4)
    seconds, pause, rollback = job_estimates(cfg, ModeStats(seconds={"off": 2.0}), 4)
    _, plain = estimates(ModeStats(seconds={"off": 2.0}), 4, 8, ("next",))
    assert rollback == pytest.approx(rollback_cost(4, 0, seconds, plain)) and rollback > plain["eager+next"]
    share = window_share(4, 8)
    assert pause["eager+next"] == pytest.approx((1 - share) * plain["eager+next"] + share * rollback)
    no_interval = JobConfig.of(stages=4, microbatches=8, replica_sync="next", redundancy="auto", checkpoint="/tmp/ck")
    assert job_estimates(no_interval, ModeStats(seconds={"off": 2.0}), 4)[1:] == (plain, None)


def test_with_both_syncs_every_mode_is_weighed_with_each_and_rare_deaths_take_the_late_sync():
    """--replica-sync auto: each mode with its sync at the iteration's end and in the
    next one, each estimated as the single sync estimates it; the late sync's
    shorter iteration wins while deaths are rare, the end's whole failover once they
    are frequent (a death in the late sync's window costs a rollback here); and the
    choice over the five agrees with the brute force."""
    from agents.modes import parts, settings
    stats, rollback = ModeStats(seconds={"off": 2.0}), (lambda s, p: 100.0)
    seconds, pause = estimates(stats, 4, 8, ("end", "next"), rollback)
    assert tuple(seconds) == settings(("end", "next")) == ("eager", "eager+next", "lazy", "lazy+next", "off")
    for name in seconds:
        alone = estimates(stats, 4, 8, (parts(name)[1],), rollback)
        assert (seconds[name], pause[name]) == (alone[0][name], alone[1][name])
    assert seconds["eager+next"] < seconds["eager"] and pause["eager+next"] > pause["eager"]
    assert choose("", 0.0, 4, 1, seconds, pause) == "eager+next"
    assert choose("", 100.0, 4, 1, seconds, pause) == "eager"
    rng = random.Random(7)
    names = list(seconds)
    for _ in range(500):
        s = {n: rng.uniform(0.5, 2.0) for n in names}
        p = {n: rng.uniform(0.0, 60.0) for n in names}
        rate, pipelines, current = rng.choice([0, 1, 100]), rng.randint(1, 3), rng.choice(names + [""])
        cost = {n: s[n] * (1 + rate * 4 * p[n] / 3600) for n in names if n != "off" or pipelines >= 2}
        best = min(cost.values())
        want = {current} if current in cost and best >= cost[current] * (1 - MARGIN) else \
            {n for n, c in cost.items() if c == best}
        assert choose(current, rate, 4, pipelines, s, p) in want


MEASURED = {"forward": [1.0, 1.2, 1.1, 1.4], "backward": [2.0, 2.3, 2.2, 2.9], "transfer": 0.02, "send": 0.02,
            "swap": 0.3, "load": 0.0, "reduce": 0.0, "step": 0.2, "sync_transfer": 1.5, "frc_factor": 1.25,
            "brc_factor": 1.0, "input_share": 0.5}  # a sync that flies a forward and a half


def test_the_window_is_weighed_on_the_jobs_measured_cost_model():
    """The cost model the boundary agreed from the nodes' op times (ModeStats.costs)
    sets the window: the schedule's own windows on that model (schedules/syncs.py,
    simulated here directly), larger than the default model's where the sync flies
    longer; a death in it is charged on that share."""
    from agents.modes import measured_cost, window_share
    from schedules.cost import CostModel
    from schedules.syncs import windows
    cost = CostModel(**MEASURED)
    report = simulate(compile_schedule(4, 8, (), ScheduleOptions(redundancy="eager", sync="next"), cost))
    direct = sum(w.share for w in windows(report, cost, 4, 1)) / 4
    assert measured_cost(MEASURED, 4) == cost and window_share(4, 8, 1, cost) == pytest.approx(direct, rel=1e-12)
    assert direct > 2 * window_share(4, 8)
    stats = ModeStats(seconds={"off": 2.0}, costs=MEASURED)
    _, plain = estimates(stats, 4, 8, ("next",))
    _, charged = estimates(stats, 4, 8, ("next",), lambda s, p: 100.0)
    assert charged["eager+next"] == pytest.approx((1 - direct) * plain["eager+next"] + direct * 100.0)


@pytest.mark.parametrize("costs", [
    None, "fast", {**MEASURED, "extra": 1.0}, {**MEASURED, "sync_transfer": -1.0}, {**MEASURED, "step": "x"},
    {**MEASURED, "forward": [1.0, 1.0]}, {**MEASURED, "forward": 1.0}, {**MEASURED, "backward": ["a"] * 4},
])
def test_a_cost_model_read_from_etcd_that_is_not_one_is_not_used(costs):
    from agents.modes import measured_cost
    assert measured_cost(costs, 4) is None
    _, pause = estimates(ModeStats(seconds={"off": 2.0}, costs=costs), 4, 8, ("next",), lambda s, p: 100.0)
    assert pause == estimates(ModeStats(seconds={"off": 2.0}), 4, 8, ("next",), lambda s, p: 100.0)[1]


def test_observe_keeps_the_newest_agreed_cost_model():
    s = observe(ModeStats(), 1000.0, 4, 0, "eager+next", False, costs=MEASURED)
    assert s.costs == MEASURED
    s = observe(s, 1002.0, 4, 0, "eager+next", False)
    assert s.costs == MEASURED  # a boundary that agreed none leaves it
    newer = {**MEASURED, "sync_transfer": 0.1}
    assert observe(s, 1004.0, 4, 0, "eager+next", False, costs=newer).costs == newer


def test_the_agents_read_the_cost_model_their_boundary_agreed():
    """agreed_costs: the last try's record, its first pipeline's model; none where
    the boundary agreed none or the record is not one."""
    from agents.membership import agreed_costs
    from bamboo.control.protocol import Regroup
    records = {4: {0: Regroup((), False, costs={"0": {"step": 1.0}}), 1: Regroup((), False, costs={"0": MEASURED})},
               5: {0: Regroup((), False)}, 6: {0: Regroup((), False, costs={"0": "junk"})}}
    assert agreed_costs(records[4]) == MEASURED
    assert agreed_costs(records[5]) is None and agreed_costs(records[6]) is None
    assert agreed_costs({}) is None
