"""The progress bar of a local run (bamboo-train without --no-progress): rich, on
stderr, one update per iteration recorded."""
from __future__ import annotations


class ProgressBar:
    """A rich progress bar on stderr (or nothing): iteration, loss, samples/s, nodes."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda it, record: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("iteration {task.completed}/{task.total}"), BarColumn(),
                            TextColumn("loss {task.fields[loss]}  {task.fields[rate]} samples/s  "
                                       "{task.fields[nodes]} nodes"), TimeElapsedColumn(),
                            transient=False)
        self.bar.start()
        self.task = self.bar.add_task("train", total=self.total, loss="-", rate="-", nodes="-")

        def update(it, record):
            rate = record["samples"] / record["seconds"] if record["seconds"] else 0.0
            self.bar.update(self.task, completed=it + 1, loss=f"{record['loss']:.4f}", rate=f"{rate:.1f}",
                            nodes=record["nodes"])
        return update

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()
        return False
