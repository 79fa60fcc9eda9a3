"""scripts/bench_single.py end to end on tiny settings: both sides run, the JSON
holds what the issue asks for, and the two sides computed the same losses. No
timed assertion: the figures depend on the machine (docs/HOTPATH.md)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "bench_single.py")
TINY = ["--rounds", "1", "--iterations", "4", "--warm", "1", "--check", "2", "--seq", "32", "--batch", "2",
        "--microbatches", "2"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def bench(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_bench_single_writes_both_sides_and_the_losses_agree(tmp_path):
    out = tmp_path / "single.json"
    run = bench(*TINY, "--model", "hf:llama-tiny", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    for side in ("bamboo", "bare"):
        assert result[side]["tokens_per_s"] > 0 and result[side]["peak_memory_mb"] > 0
        assert len(result[side]["losses"]) == 2
    assert result["ratio"] > 0 and len(result["ratio_interval"]) == 2
    assert result["losses_match"] and result["loss_max_rel_diff"] <= 1e-3
    assert result["parameters"]["model"] == "hf:llama-tiny" and result["parameters"]["precision"].startswith("bf16")
    assert result["parameters"]["config"]["attention_dropout"] == 0.0
    assert "ratio bamboo/bare tokens/s" in run.stdout and "the same math" in run.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["single.json"]  # no temp file left beside it


@pytest.mark.parametrize("args, says", [
    (["--rounds", "0"], "--rounds"),
    (["--model", "tiny"], "--model 'tiny'"),
    (["--device", "tpu"], "--device"),
    (["--iterations", "3", "--warm", "3"], "--iterations"),
    (["--json", "/nonexistent-dir/x.json"], "--json '/nonexistent-dir/x.json': cannot write a file there"),
])
def test_a_bad_argument_is_one_line_and_status_2(args, says):
    run = bench(*args)
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""
