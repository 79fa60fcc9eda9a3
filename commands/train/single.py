"""`bamboo-train --stages 1 --pipelines 1`: the reference run, with the same
metrics and saved parameters as a distributed job."""
from __future__ import annotations

import os
import resource
import time

import torch

from commands.train.progress import ProgressBar
from commands.train.metrics import MetricsWriter, add_loss_scale
from commands.train.reference import train_reference
from bamboo.control.config import JobConfig
from bamboo.state.holdings import save_layer
from bamboo.transport import devices


def run_single(cfg: JobConfig, metrics_out: str | None, progress: bool = True, sinks: tuple = ()) -> None:
    metrics = MetricsWriter(metrics_out, sinks)
    start = last = time.monotonic()
    validation: dict[int, float] = {}
    scales: dict = {}
    skipped = 0
    with ProgressBar(progress, cfg.schedule.iterations) as bar:
        def on_iteration(it, losses):
            nonlocal last, skipped
            now = time.monotonic()
            m = cfg.schedule.microbatches
            record = {"iteration": it, "loss": sum(losses[g] for g in range(m)) / m,
                      "samples": cfg.schedule.samples, "seconds": round(now - last, 4), "nodes": 1,
                      "events": []}
            if it in scales:
                add_loss_scale(record, scales.pop(it))
            if it in validation:
                record["val_loss"] = validation.pop(it)
            last = now
            skipped += any(e["type"] == "overflow" for e in record["events"])
            metrics.write(record)
            bar(it, record)
        device = devices.claim(0, cfg.devices.names, share=True)  # the first worker's device
        model = train_reference(cfg, on_iteration, validation.__setitem__, scales.__setitem__, device)
    total = time.monotonic() - start
    metrics.write({"summary": {"iterations": cfg.schedule.iterations,
                               "samples": cfg.schedule.iterations * cfg.schedule.samples,
                               "total_seconds": round(total, 3),
                               "mean_iteration_seconds": round(total / cfg.schedule.iterations, 4),
                               "peak_memory_mb": {"0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                               **({"peak_cuda_mb": {"0": torch.cuda.max_memory_allocated(device) / 2**20}}
                                  if device.type == "cuda" else {}),
                               **({"skipped_steps": skipped} if cfg.recipe.loss_scaling else {})}})
    metrics.close()
    if cfg.checkpoints.save_dir:
        os.makedirs(cfg.checkpoints.save_dir, exist_ok=True)
        for index, layer in enumerate(model.layers):
            save_layer(layer, os.path.join(cfg.checkpoints.save_dir, f"layer{index}.pt"))
