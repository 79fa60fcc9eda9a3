"""Every paid node trains in the cluster simulator, against hand-computed
cases: a preemption notice drained ahead, a checkpoint on notice, a rollback from
checkpoint copies in peers' memory or from storage, idle nodes, short pipelines
against the schedule simulator and a brute-force split, and the command's defaults."""
import itertools
import json
import os
from dataclasses import replace

import pytest

from schedules.compiler import compile_schedule, simulate

from agents.policy import Config, lay_out, next_config
from sim.command import main
from sim.profiles import PROFILES, STATE_BYTES_PER_PARAM
from sim.reconfiguration import memory_copies
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event
from schedules.options import ScheduleOptions

BERT = PROFILES["bert-large"]
P3 = os.path.join(os.path.dirname(__file__), "..", "..", "..", "traces", "ec2-p3-trace.csv")


def rate(pipelines, redundancy="off"):
    m = -(-BERT.microbatches // pipelines)
    makespan = simulate(compile_schedule(2, m, (), options=ScheduleOptions(redundancy=redundancy), cost=BERT.cost(2, pipelines))).makespan
    return BERT.samples_per_iteration() / (makespan / 1000)


def start(nodes, zones="ab"):
    return [Event(0, "add", f"n{i}", zones[i % len(zones)]) for i in range(nodes)]


def test_a_noticed_preemption_is_drained_to_the_standby_and_costs_no_redo():
    # n0..n3 make two pipelines, n4 waits; n1's preemption is announced 120 s ahead:
    # at 880 s n4 takes stage 1 from n1 itself (a reconfiguration), at 1000 s nothing is lost
    events = start(5) + [Event(1000, "remove", "n1", "b")]
    opt = Options(free_checkpoints=True, max_stages=1, notice_seconds=120, surplus="keep")
    r = ClusterSimulator(BERT, 2, "redo", opt).run(events, hours=1.0)
    reload = BERT.stage_params(2) * STATE_BYTES_PER_PARAM / opt.peer_bandwidth
    pause = opt.reconfigure_seconds + reload
    assert r["samples"] == pytest.approx(rate(2) * 880 + rate(2) * (3600 - 880 - pause), abs=1)
    assert (r["fatal_failures"], r["redone_from_peers"], r["partial_iterations_lost_samples"]) == (0, 0, 0)
    assert r["notices_drained"] == 1
    unannounced = ClusterSimulator(BERT, 2, "redo", Options(free_checkpoints=True, max_stages=1)).run(events, 1.0)
    assert unannounced["redone_from_peers"] == 1 and unannounced["samples"] < r["samples"]


def test_on_demand_is_not_moved_by_notices():
    events = start(4) + [Event(1800, "remove", "n3", "b")]
    plain = ClusterSimulator(BERT, 2, "on-demand").run(events, hours=1.0)
    noticed = ClusterSimulator(BERT, 2, "on-demand", Options(notice_seconds=600)).run(events, hours=1.0)
    assert plain["samples"] == noticed["samples"] and plain["mean_nodes"] == noticed["mean_nodes"] == 4.0


def test_checkpoint_restart_writes_a_checkpoint_on_notice_and_loses_no_work():
    events = start(4) + [Event(1800, "remove", "n3", "b")]
    opt = Options(checkpoint_seconds=1200, restart_seconds=120, max_stages=1, notice_seconds=120)
    sim = ClusterSimulator(BERT, 2, "checkpoint", opt)
    r = sim.run(events, hours=1.0)
    w = sim.costs.write_seconds
    # two pipelines to 1800 s (one stall at 1200 s), a write on notice, the restart, one
    # pipeline that stalls once more 1200 s after the restart
    expected = rate(2) * (1800 - w) + rate(1) * (3600 - 1800 - w - 120 - w)
    assert r["samples"] == pytest.approx(expected, abs=1)
    without = ClusterSimulator(BERT, 2, "checkpoint", Options(checkpoint_seconds=1200, restart_seconds=120,
                                                              max_stages=1)).run(events, hours=1.0)
    assert without["samples"] < r["samples"]  # it went back to 1200 s


def test_a_stage_lost_everywhere_rolls_back_from_a_peer_s_memory_without_a_relaunch():
    # stage 1 dies in both pipelines at once: the checkpoint of 600 s comes back
    # from the copy the other pipeline's stage-0 node holds in memory. No process
    # relaunches.
    events = start(4)
    stage1 = [pipe[1] for pipe in next_config({e.node: e.zone for e in events}, None, 2).pipelines]
    opt = Options(checkpoint_seconds=600, max_stages=1)
    sim = ClusterSimulator(BERT, 2, "redo", opt)
    r = sim.run(events + [Event(1000, "remove", n, "b") for n in stage1], hours=1.0)
    assert r["fatal_failures"] == 1
    pause = opt.failure_timeout + opt.reconfigure_seconds + BERT.stage_state_bytes(2) / opt.peer_bandwidth
    w = sim.costs.write_seconds
    # 600 s of two pipelines less one write, then one pipeline (the survivors) from
    # the rollback's end, stalling for a write every 600 s of training
    after = 3600 - 1000 - pause
    expected = rate(2) * (600 - w) + rate(1) * (after - w * (after // (600 + w)))
    assert r["samples"] == pytest.approx(expected, rel=2e-3)
    relaunch = ClusterSimulator(BERT, 2, "redo", Options(checkpoint_seconds=600, max_stages=1, rollback="relaunch"))
    assert relaunch.run(events + [Event(1000, "remove", n, "b") for n in stage1], 1.0)["samples"] < r["samples"]


def test_the_copies_are_kept_where_no_two_neighbours_take_both_and_storage_serves_the_rest():
    config = Config(0, 4, (("a", "b", "c", "d"),))
    zones = {"a": "x", "b": "y", "c": "x", "d": "y"}
    copies = memory_copies(config, zones)
    assert copies == {0: {"a", "c"}, 1: {"b", "d"}, 2: {"c", "a"}, 3: {"d", "b"}}  # two stages on, the runtime's rule
    for s in range(4):  # any two neighbours dead: a copy of every stage lives
        dead = {config.pipelines[0][s], config.pipelines[0][(s + 1) % 4]}
        assert all(copies[t] - dead for t in range(4))
    sim = ClusterSimulator(BERT, 4, "redo", Options(max_stages=1))
    sim.copies = copies
    opt = sim.opt
    live = {"a": "x", "c": "x"}
    from_memory = opt.failure_timeout + opt.reconfigure_seconds + BERT.stage_state_bytes(4) / opt.peer_bandwidth
    assert sim.rollback_seconds(frozenset({1}), live | {"d": "y"}) == pytest.approx(from_memory)
    from_storage = opt.failure_timeout + opt.reconfigure_seconds + sim.costs.load_seconds
    assert sim.rollback_seconds(frozenset({1}), live) == pytest.approx(from_storage)  # b and d both gone


def test_idle_nodes_are_counted_and_the_bound_is_above_every_strategy():
    events = start(5)
    keep = Options(max_stages=1, free_checkpoints=True, surplus="keep")
    whole = ClusterSimulator(BERT, 2, "redo", keep).run(events, hours=1.0)
    assert whole["idle_fraction"] == pytest.approx(0.2)  # n4 waits in standby all along
    assert whole["goodput"] == pytest.approx(whole["goodput_bound"], rel=1e-3)  # nothing fails: all is reached
    short = ClusterSimulator(BERT, 2, "redo", replace(keep, max_stages=2)).run(events, hours=1.0)
    assert short["idle_fraction"] <= whole["idle_fraction"] and short["samples"] >= whole["samples"]


def best_split_ms(depth, lengths, total, cost):
    """The slowest pipeline's makespan under the best split, by brute force, each
    pipeline compiled as the merged one it is."""
    pipes = [lay_out(tuple(range(n)), depth) for n in lengths]
    merged = [tuple(s for s in range(1, depth) if p[s] == p[s - 1]) for p in pipes]

    def ms(j, m):
        return simulate(compile_schedule(depth, m, merged[j], options=ScheduleOptions(redundancy="off"), cost=cost)).makespan
    best = None
    for counts in itertools.product(range(1, total), repeat=len(lengths)):
        if sum(counts) == total:
            worst = max(ms(j, m) for j, m in enumerate(counts))
            best = worst if best is None else min(best, worst)
    return best


def test_a_short_pipeline_s_iteration_is_the_schedule_simulator_s_best_split():
    sim = ClusterSimulator(BERT, 4, "redo", Options(max_stages=2))
    config = Config(0, 4, (("a", "b", "c", "d"), ("e", "e", "f", "f")))
    expected = best_split_ms(4, [4, 2], BERT.microbatches, BERT.cost(4, 2))
    assert sim.config_seconds(config) * 1000 == pytest.approx(expected, rel=1e-9)


def test_the_notice_defaults_by_trace_format_and_is_printed(capsys):
    assert main(["--trace", P3, "--strategy", "redo", "--model", "gpt2", "--stages", "6", "--hours", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["notice_seconds"], out["max_stages_per_node"], out["rollback"]) == (120, 2, "memory")
    assert {"goodput", "goodput_bound", "idle_fraction", "notices_drained"} <= set(out)
    assert main(["--trace", P3, "--strategy", "redo", "--model", "gpt2", "--stages", "6", "--hours", "2",
                 "--notice-seconds", "0"]) == 0
    quiet = json.loads(capsys.readouterr().out)
    assert quiet["notice_seconds"] == 0 and quiet["notices_drained"] == 0 and out["notices_drained"] > 0


def test_without_a_notice_even_free_writes_leave_the_work_since_the_checkpoint_lost():
    events = start(4) + [Event(1800, "remove", "n3", "b")]
    opt = Options(checkpoint_seconds=1200, restart_seconds=120, max_stages=1, free_checkpoints=True)
    r = ClusterSimulator(BERT, 2, "checkpoint", opt).run(events, hours=1.0)
    assert r["samples"] == pytest.approx(rate(2) * 1200 + rate(1) * (3600 - 1800 - 120), abs=1)
