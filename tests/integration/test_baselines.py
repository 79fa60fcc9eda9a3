"""The honest baselines of bamboo-sim against independent references: Young's and
Daly's formulas on a synthetic trace of known MTBF, a brute-force sweep of fixed
checkpoint intervals, and redo-from-peers on tiny traces computed by hand."""
import json
import math
import subprocess
import sys

import pytest

from schedules.compiler import compile_schedule, simulate

from sim.checkpointing import daly_interval, optimal_interval, trace_stats, young_interval
from sim.profiles import PROFILES, STATE_BYTES_PER_PARAM, profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event, synthetic
from schedules.options import ScheduleOptions

BERT = PROFILES["bert-large"]


def rate(pipelines):
    """Samples/s of D healthy pipelines without redundancy, from the schedule simulator."""
    m = -(-BERT.microbatches // pipelines)
    makespan = simulate(compile_schedule(2, m, (), options=ScheduleOptions(redundancy="off"), cost=BERT.cost(2, pipelines))).makespan
    return BERT.samples_per_iteration() / (makespan / 1000)


def test_the_formulas():
    assert young_interval(8, 900) == pytest.approx(120)
    # Daly's estimate: sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C; M itself once C >= 2M
    r = 8 / 1800
    assert daly_interval(8, 900) == pytest.approx(120 * (1 + math.sqrt(r) / 3 + r / 9) - 8)
    assert daly_interval(50, 20) == 20
    assert optimal_interval("young", 8, math.inf) == math.inf
    with pytest.raises(ValueError, match="formula"):
        optimal_interval("guess", 8, 900)


def test_young_interval_from_a_synthetic_trace_of_known_mtbf():
    # 8 nodes preempted at 0.5 per node-hour, refilled at once: the node MTBF is 2 hours
    events = synthetic(200, 8, ("a", "b"), 0.5, seed=3, refill_seconds=0.0)
    stats = trace_stats(events, 200 * 3600)
    assert stats.node_hours == pytest.approx(8 * 200, rel=1e-6)
    assert stats.node_mtbf_seconds == pytest.approx(2 * 3600, rel=0.05)
    sim = ClusterSimulator(BERT, 2, "checkpoint", Options(checkpoint_formula="young", surplus="keep"))
    result = sim.run(events, 200)
    C = sim.costs.write_seconds
    assert C == pytest.approx(BERT.stage_params(2) * 12 * (1 / 10e9 + 1 / 0.5e9))
    # n nodes in use: the job's MTBF is the node MTBF over n; all 8 are, in 4 pipelines
    assert sim.checkpoint_interval(4) == pytest.approx(math.sqrt(2 * C * stats.node_mtbf_seconds / 4))
    assert result["checkpointing"]["formula"] == "young"
    assert result["checkpointing"]["mean_interval_seconds"] == pytest.approx(sim.checkpoint_interval(8), abs=0.01)


def test_no_fixed_interval_beats_the_formula():
    """Brute force: on traces of independent preemptions (job MTBF about 10 minutes),
    fixed intervals from 10 s to 12 minutes do no better than Daly's or Young's."""
    traces = [synthetic(24, 4, ("a", "b"), 1.5, seed, refill_seconds=300) for seed in range(4)]

    def value(options):
        return sum(ClusterSimulator(BERT, 2, "checkpoint", options).run(t, 24)["value"] for t in traces) / len(traces)

    best_fixed = max(value(Options(checkpoint_seconds=10 * 1.25 ** k)) for k in range(20))
    for formula in ("daly", "young"):
        assert value(Options(checkpoint_formula=formula)) >= best_fixed * 0.99
    assert value(Options(checkpoint_seconds=1800)) < best_fixed * 0.7  # the old 30 minutes


def start(nodes):
    return [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(nodes)]


def test_redo_reloads_a_lost_stage_from_the_peer_pipeline():
    # n0..n3 make two pipelines, n4 waits; n1 dies at 1000 s and n4 takes stage 1
    # from the other pipeline's copy: no checkpoint is read
    opt = Options(free_checkpoints=True, max_stages=1, surplus="keep")  # whole pipelines: n4 waits in standby
    sim = ClusterSimulator(BERT, 2, "redo", opt)
    r = sim.run(start(5) + [Event(1000, "remove", "n1", "b")], hours=1.0)
    per_iteration = BERT.samples_per_iteration()
    partial = rate(2) * 1000 % per_iteration  # the iteration under way is dropped
    reload = BERT.stage_params(2) * STATE_BYTES_PER_PARAM / 1e9
    pause = opt.failure_timeout + opt.reconfigure_seconds + reload
    assert r["samples"] == pytest.approx(rate(2) * 1000 - partial + rate(2) * (2600 - pause), abs=1)
    assert (r["fatal_failures"], r["redone_from_peers"]) == (0, 1)
    assert r["partial_iterations_lost_samples"] == round(partial)
    assert r["peer_reload_seconds"] == pytest.approx(reload, abs=1e-3)


def test_redo_without_a_copy_goes_back_to_the_checkpoint():
    # stage 1 dies in both pipelines at once: no copy is left
    opt = Options(checkpoint_seconds=600, free_checkpoints=True, restart_seconds=100, max_stages=1,
                  rollback="relaunch")
    r = ClusterSimulator(BERT, 2, "redo", opt).run(
        start(4) + [Event(1000, "remove", "n1", "b"), Event(1000, "remove", "n3", "b")], hours=1.0)
    assert r["fatal_failures"] == 1 and r["redone_from_peers"] == 0
    # the checkpoint of 600 s, then one pipeline from the end of the restart
    assert r["samples"] == pytest.approx(rate(2) * 600 + rate(1) * (3600 - 1100), abs=1)


def test_redo_runs_without_redundancy():
    redo = ClusterSimulator(BERT, 2, "redo")
    assert redo.iteration_seconds(2) == ClusterSimulator(BERT, 2, "checkpoint").iteration_seconds(2)
    assert redo.iteration_seconds(2) < ClusterSimulator(BERT, 2, "bamboo").iteration_seconds(2)


def test_calibrated_profile_says_what_was_measured():
    cal, arith = profile("gpt2", "calibrated"), profile("gpt2", "arithmetic")
    assert cal.calibration is not None and arith.calibration is None
    c = cal.calibration
    cost = cal.cost(12)
    assert cost.forward == pytest.approx(c.forward_ms * c.gemm_flops / (125e12 * 0.3) * 4)
    assert cost.backward == pytest.approx(c.backward_ms * c.gemm_flops / (125e12 * 0.3) * 4)
    assert cost.step == pytest.approx(c.step_ms * c.copy_bytes_per_s / (900e9 * 0.8) * 4)
    assert cal.sources()["numbers"]["forward"].startswith("measured")
    assert arith.sources()["numbers"]["forward"] == "arithmetic"
    # the measurement agrees with the arithmetic within a factor of two
    assert 0.5 < cost.forward / arith.cost(12).forward < 2


def test_fixed_interval_and_free_writes_stay_reachable(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("time,action,node\n" + "".join(f"0,add,n{i}\n" for i in range(4)) + "1800,remove,n3\n")
    res = subprocess.run([sys.executable, "-m", "sim.command", "--trace", str(trace), "--strategy", "checkpoint",
                          "--model", "bert-large", "--stages", "2", "--checkpoint-minutes", "30",
                          "--free-checkpoints", "--restart-seconds", "120"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    params = json.loads(res.stdout)["checkpointing"]
    assert params["formula"] == "fixed" and params["interval_seconds"] == 1800
    assert params["write_seconds"] == 0 and params["restart_seconds"] == 120 and params["restart_fixed"]
