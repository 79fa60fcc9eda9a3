"""Soak (slow, `make test-slow`): kill every node at many points of an iteration,
with eager and with lazy redundancy, and check the losses against the reference
each time."""
import json
import subprocess
import sys

import pytest

from schedules.compiler import compile_schedule
from schedules.options import ScheduleOptions

from commands.train.reference import train_reference
from bamboo.control.config import JobConfig

P, M, ITERS = 4, 4, 3
POINTS = [(mode, n, k) for mode in ("eager", "lazy")
          for n, stream in compile_schedule(P, M, (), options=ScheduleOptions(redundancy=mode)).streams.items() for k in range(0, len(stream), 3)]


@pytest.fixture(scope="module")
def reference_losses():
    out = []
    train_reference(JobConfig.of(microbatches=M, iterations=ITERS, dtype="float64"),
                    lambda it, losses: out.append(sum(losses.values()) / M))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode,node,k", POINTS)
def test_kill_point(tmp_path, reference_losses, mode, node, k):
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--stages", str(P), "--microbatches", str(M),
                          "--iterations", str(ITERS), "--dtype", "float64", "--no-progress", "--redundancy", mode,
                          "--preempt", f"{node}@1:{k}", "--metrics-out", str(metrics)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-1500:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()][:-1]
    assert [r["loss"] for r in records] == pytest.approx(reference_losses, rel=1e-6)
    assert records[-1]["nodes"] == P - 1
