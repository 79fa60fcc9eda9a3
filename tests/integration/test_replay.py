"""bamboo-replay: a slice of the real EC2 g4dn trace drives a real local cluster
(agents SIGKILLed and started as the trace says); nothing trained is lost, and the
simulator's prediction for the same slice comes with it."""
import json
import os
import subprocess
import sys

import pytest

from sim.replay import slice_trace
from sim.traces import read

G4DN = os.path.join(os.path.dirname(__file__), "..", "..", "traces", "ec2-g4dn-trace.csv")


def test_slicing_thins_and_compresses():
    events = read(G4DN)
    part = slice_trace(events, 2 * 3600, 3600, thin=3, speedup=60)
    at_start = [e for e in part if e.time == 0.0]
    assert all(e.action == "add" for e in at_start) and len(at_start) == 2
    later = [e for e in part if e.time > 0]
    assert all(0 < e.time < 60 for e in later)
    # every kept event is a real one of every third node, at its time / 60
    order = list(dict.fromkeys(e.node for e in events))
    for e in later:
        assert order.index(e.node) % 3 == 0
        assert any(x.node == e.node and x.action == e.action and abs(x.time - (2 * 3600 + e.time * 60)) < 1e-6
                   for x in events)


def replay(*args, timeout=400):
    out = subprocess.run([sys.executable, "-m", "sim.replay", G4DN, *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.slow  # make test stays under 15 minutes; bad input and slicing stay in it
def test_replay_of_a_trace_slice_loses_no_sample():
    # 20 trace minutes at 2h, every third node: three nodes, two join; 20 s of wall time
    part = slice_trace(read(G4DN), 2 * 3600, 0.34 * 3600, thin=3, speedup=60)
    result = replay("--start-hours", "2", "--hours", "0.34", "--speedup", "60", "--thin", "3")
    assert result["samples_lost"] == 0 and result["samples"] > 0
    assert result["preemptions"] == sum(e.action == "remove" for e in part) == 0
    assert result["mean_nodes"] > 3
    predicted = result["predicted"]
    for key in ("preemptions", "fatal_failures", "mean_nodes", "throughput", "cost_per_hour", "value", "samples"):
        assert key in result and key in predicted
    assert predicted["mean_nodes"] == pytest.approx(result["mean_nodes"], rel=0.2)


@pytest.mark.slow
def test_replay_throughput_within_a_quarter_of_the_prediction():
    """The hour at 2h of the g4dn trace (every third node), a minute of wall time:
    joins and preemptions. Measured throughput within 25% of the prediction."""
    result = replay("--start-hours", "2", "--hours", "1", "--speedup", "60", "--thin", "3")
    assert result["samples_lost"] == 0 and result["preemptions"] == 1
    assert 0.75 <= result["throughput_ratio"] <= 1.25, result


def test_bad_replay_arguments_are_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,node1\nzero,remove,node1\n")
    for args, needle in (([str(bad)], ":2:"), ([G4DN, "--speedup", "0"], "--speedup must be positive")):
        out = subprocess.run([sys.executable, "-m", "sim.replay", *args], capture_output=True, text=True, timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr


@pytest.mark.parametrize("args,needle", [
    (["--hours", "inf"], "--hours must be a finite number"),
    (["--start-hours", "-5"], "--start-hours must be 0 or more"),
    (["--zones", ",,"], "--zones must be names"),
    (["--model", "nope"], "--model 'nope'"),
])
def test_every_replay_argument_is_checked_before_the_job_starts(capsys, args, needle):
    """In this process (the command's own run is checked above): no job starts."""
    from sim.replay import main
    assert main([G4DN, *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines

