"""The metrics file: one JSON line per iteration (loss, samples, seconds, live
nodes, events), and a summary line at the end, written to a temp file and renamed
into place. The launcher and the single-process run both write it this way."""
from __future__ import annotations

import json
import os
import tempfile

from commands.train.reference import mean_loss
from bamboo.control.config import JobConfig
from bamboo.control.events import EvalSkipped, Overflow


class LaunchError(RuntimeError):
    """The job could not finish (here: an iteration's losses did not all arrive);
    the message says why."""


class MetricsWriter:
    """JSON lines written to a temp file and renamed into place at the end, so a
    reader never sees a half-written file. Each record also goes, as it is written,
    to every sink (`add(record)`, then `close()` at the end): the TensorBoard
    writer and the figure (`commands/train/board.py`, `commands/train/plot.py`) see exactly what
    the file holds, on every path that writes metrics."""

    def __init__(self, path: str | None, sinks: tuple = ()):
        self.path, self.lines, self.sinks = path, [], sinks

    def write(self, record: dict) -> None:
        self.lines.append(json.dumps(record))
        for sink in self.sinks:
            sink.add(record)

    def close(self) -> None:
        try:
            self._write_file()
        finally:
            for sink in self.sinks:
                sink.close()

    def _write_file(self) -> None:
        if not self.path or not self.lines:
            return  # nothing ran: no file, rather than an empty one
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        os.replace(tmp, self.path)


def iteration_record(cfg: JobConfig, it: int, losses: dict, reports: dict, seconds: float, nodes: int,
                     events: list) -> dict:
    m = cfg.schedule.microbatches
    if sorted(losses) != list(range(m)):
        raise LaunchError(f"iteration {it}: {len(losses)} of {m} microbatch losses arrived")
    record = {"iteration": it, "loss": sum(losses[g].value for g in range(m)) / m,
              "samples": cfg.schedule.samples, "seconds": round(seconds, 4), "nodes": nodes,
              "events": events}
    if cfg.testing.check_replicas:
        record["replicas_equal"] = replicas_equal(cfg, reports)
    return record


def add_loss_scale(record: dict, scale) -> None:
    """fp16: the loss scale the iteration ran with; an `overflow` event when every
    copy skipped its step (the scale halves for the next)."""
    record["loss_scale"] = scale.scale
    if scale.overflow:
        record["events"].append(Overflow(record["iteration"], scale.scale).to_dict())


def add_validation(cfg: JobConfig, record: dict, losses: dict) -> None:
    """An evaluated iteration's `val_loss`; or, when a death cut the evaluation
    short (some validation losses never arrived), an `eval_skipped` event."""
    if sorted(losses) == list(range(cfg.data.eval_batches)):
        record["val_loss"] = mean_loss({g: loss.value for g, loss in losses.items()}, cfg.data.eval_batches)
    else:
        record["events"].append(EvalSkipped(record["iteration"], len(losses), cfg.data.eval_batches).to_dict())


def replicas_equal(cfg: JobConfig, reports: dict) -> bool:
    """Every copy of a stage (owner, replica, other pipelines) has one digest."""
    by_stage: dict[str, set] = {}
    for r in reports.values():
        for stage, d in r.digests.items():
            by_stage.setdefault(stage, set()).add(d)
    return len(by_stage) == cfg.schedule.stages and all(len(d) == 1 for d in by_stage.values())
