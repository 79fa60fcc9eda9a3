"""`bamboo-train --tensorboard DIR`: the metrics' scalars written as iterations
finish, so `tensorboard --logdir DIR` shows a run while it trains.

It runs in the launcher process (or the single-process run), fed by the metrics
writer; workers never see it. The step is the iteration: an iteration run again
after a redo is written again at its step (TensorBoard keeps the newest).
"""
from __future__ import annotations

import json
from collections import Counter


class Board:
    """Per iteration: `loss`, `val_loss` (when the record has one), `samples_per_second`,
    `nodes`, `seconds`, `events/<type>` (how many of that type), and the events
    themselves as a text entry; the summary as text at the end."""

    def __init__(self, directory: str):
        self.directory = directory
        self.writer = None  # made at the first record: a run that never starts leaves no event file

    def add(self, record: dict) -> None:
        writer = self._writer()
        if "summary" in record:
            writer.add_text("summary", json.dumps(record["summary"]))
            writer.flush()
            return
        step = record["iteration"]
        writer.add_scalar("loss", record["loss"], step)
        if record.get("val_loss") is not None:
            writer.add_scalar("val_loss", record["val_loss"], step)
        rate = record["samples"] / record["seconds"] if record["seconds"] else 0.0
        writer.add_scalar("samples_per_second", rate, step)
        writer.add_scalar("nodes", record["nodes"], step)
        writer.add_scalar("seconds", record["seconds"], step)
        events = record.get("events", [])
        for kind, count in Counter(e["type"] for e in events).items():
            writer.add_scalar(f"events/{kind}", count, step)
        if events:
            writer.add_text("events", "\n".join(f"- `{json.dumps(e)}`" for e in events), step)
        writer.flush()  # live: a reader sees the iteration now, not at the next periodic flush

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _writer(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.directory)
        return self.writer
