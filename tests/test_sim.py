"""The cluster simulator: hand-computed small cases, the real EC2 p3 trace with
GPT-2 at P=12 (the Bamboo paper's setting), and the bamboo-sim command."""
import json
import os
import subprocess
import sys

import pytest

from agents.policy import next_config
from schedules.compiler import compile_schedule, simulate
from sim.profiles import PROFILES
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event

P3 = os.path.join(os.path.dirname(__file__), "..", "traces", "ec2-p3-trace.csv")
BERT = PROFILES["bert-large"]


def rate(pipelines, redundancy):
    """Samples/s of D healthy pipelines, straight from the schedule simulator."""
    m = -(-BERT.microbatches // pipelines)
    makespan = simulate(compile_schedule(2, m, (), redundancy, cost=BERT.cost(2, pipelines))).makespan
    return BERT.samples_per_iteration() / (makespan / 1000)


def four_nodes_one_preempted():
    start = [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)]
    return start + [Event(1800, "remove", "n3", "b"), Event(3600, "add", "n4", "b")]


def test_checkpoint_restart_loses_the_work_since_the_checkpoint():
    opt = Options(checkpoint_seconds=1200, restart_seconds=120)
    r = ClusterSimulator(BERT, 2, "checkpoint", opt).run(four_nodes_one_preempted(), hours=1.0)
    # two pipelines until 1800 s, back to the checkpoint at 1200 s, restart, one pipeline
    expected = rate(2, "off") * 1200 + rate(1, "off") * (1800 - 120)
    assert r["samples"] == pytest.approx(expected, abs=1)
    assert r["fatal_failures"] == 1 and r["preemptions"] == 1
    assert r["mean_nodes"] == pytest.approx(3.5) and r["cost_per_hour"] == pytest.approx(3.5 * 0.918, rel=1e-3)
    assert r["value"] == pytest.approx(r["throughput"] / r["cost_per_hour"], rel=1e-3)


def test_bamboo_pauses_one_merged_iteration_and_loses_nothing():
    sim = ClusterSimulator(BERT, 2, "bamboo")
    r = sim.run(four_nodes_one_preempted(), hours=1.0)
    merged = sim.iteration_seconds(2, merged=True)
    # the broken pipeline's survivor goes to standby: the other pipeline moves no layers
    expected = rate(2, "eager") * 1800 + rate(1, "eager") * (1800 - merged)
    assert r["samples"] == pytest.approx(expected, abs=1)
    assert r["fatal_failures"] == 0


def test_a_stage_lost_in_every_pipeline_is_fatal():
    start = [Event(0, "add", f"n{i}", "a") for i in range(4)]
    both = start + [Event(600, "remove", n, "a") for n in ("n0", "n1", "n2", "n3")]
    r = ClusterSimulator(BERT, 2, "bamboo").run(both, hours=0.5)
    assert r["fatal_failures"] == 1 and r["redone_from_peers"] == 0
    pipeline = next_config({f"n{i}": "a" for i in range(4)}, None, 2).pipelines[0]
    one = start + [Event(600, "remove", n, "a") for n in pipeline]
    r = ClusterSimulator(BERT, 2, "bamboo").run(one, hours=0.5)
    assert r["fatal_failures"] == 0 and r["redone_from_peers"] == 1


def test_ec2_p3_trace_gpt2_p12_all_strategies():
    out = {}
    for strategy in ("bamboo", "checkpoint", "on-demand"):
        res = subprocess.run([sys.executable, "-m", "sim.cli", "--trace", P3, "--strategy", strategy, "--model", "gpt2",
                              "--stages", "12", "--json"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        out[strategy] = json.loads(res.stdout)
        for key in ("preemptions", "fatal_failures", "mean_nodes", "throughput", "cost_per_hour", "value", "samples"):
            assert key in out[strategy]
    assert out["bamboo"]["preemptions"] == out["checkpoint"]["preemptions"] == 167
    assert out["on-demand"]["preemptions"] == 0
    assert out["bamboo"]["fatal_failures"] < 6  # Bamboo's own simulator: 6; peers recover the rest
    assert out["bamboo"]["value"] > out["checkpoint"]["value"] and out["bamboo"]["value"] > out["on-demand"]["value"]
    assert out["on-demand"]["cost_per_hour"] == pytest.approx(out["on-demand"]["mean_nodes"] * 3.06)


def test_sweep_writes_the_value_plot(tmp_path):
    res = subprocess.run([sys.executable, "-m", "sim.cli", "--sweep-rates", "--model", "bert-large", "--stages", "4",
                          "--seeds", "1", "--plot", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (tmp_path / "value-vs-rate.png").stat().st_size > 1000
    rows = out["sweep"]
    assert len(rows) >= 5 and all(r["on-demand"] == rows[0]["on-demand"] for r in rows)
    assert rows[-1]["checkpoint"] < rows[0]["checkpoint"]  # restarts hurt more as preemptions grow


@pytest.mark.parametrize("args,needle", [
    (["--trace", "/nonexistent.csv"], "/nonexistent.csv"),
    (["--trace", P3, "--stages", "1"], "--stages"),
    (["--trace", P3, "--hours", "-1"], "--hours"),
    (["--strategy", "bamboo"], "--trace"),
])
def test_bad_input_is_one_line(args, needle):
    res = subprocess.run([sys.executable, "-m", "sim.cli", *args], capture_output=True, text=True, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
