"""--plan's per-worker memory against a real job's measured peak on the CPU.

A scaled-down Llama (8 layers, 7.5M parameters) trains for two iterations on four
local nodes with agents at P=4, eager with FRC for every microbatch (so that
which FRC runs is fixed, not measured). Each worker's peak resident memory above
what it held before building any layer is its tensors: weights, gradients,
moments, undo copies, activations, the syncs, and on the CPU the FRC buffers
too, which a GPU keeps in host memory. glibc is told to map every allocation of
64 KiB or more on its own, so that memory freed goes back and the resident size
follows the live tensors. The plan (computed here, in-process) must be within
15% of it for every stage.
"""
import json
import os
import subprocess
import sys

import pytest

from bamboo.model.activations import layer_bytes
from bamboo.model.api import ModelSource
from commands.train import cli
from commands.train.flags import build_parser
from commands.train.plan import make_plan

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512, "vocab_size": 4096}
MIB = 1 << 20


@pytest.mark.slow  # eight processes starting (about 40 s of this machine's two cores): make test-slow
def test_the_plan_is_within_15_percent_of_each_workers_measured_peak(tmp_path):
    model = tmp_path / "llama-small.json"
    model.write_text(json.dumps(CONFIG))
    flags = ["--model-config", str(model), "--seq", "256", "--batch", "2", "--microbatches", "8", "--stages", "4",
             "--local-nodes", "4", "--frc", "all"]
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--iterations", "2",
                          "--metrics-out", str(metrics), *flags], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]["summary"]
    (pipeline,) = records[0]["events"][0]["pipelines"]  # stage -> node
    cfg = cli.config_from_args(build_parser().parse_args(flags))
    source = ModelSource.of(cfg.model)
    plan = make_plan(cfg, source.costs(), layer_bytes(source), (4, 256))
    rows = []
    for stage, node in enumerate(pipeline):
        measured = (summary["peak_memory_mb"][str(node)] - summary["base_memory_mb"][str(node)]) * MIB
        planned = plan.stages[stage].gpu_total + plan.stages[stage].host["FRC swapped"]  # one memory on the CPU
        rows.append((stage, node, planned, measured))
    print("stage node planned_mib measured_mib planned/measured (flags: " + " ".join(flags) + ")")
    for stage, node, planned, measured in rows:
        print(f"{stage:5} {node:4} {planned / MIB:11.1f} {measured / MIB:12.1f} {planned / measured:16.3f}")
    for stage, node, planned, measured in rows:
        assert abs(planned - measured) <= 0.15 * measured, (stage, planned / MIB, measured / MIB)
