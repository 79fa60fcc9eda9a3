"""What one simulated run has earned and spent so far, and the summary it ends with.

Kept apart from the simulator's event loop and from the strategies so that both
change the same ledger in the same few ways (pause, checkpoint, rewind) and every
strategy reports in the same shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    t: float = 0.0
    samples: float = 0.0
    saved: float = 0.0          # samples in the last checkpoint
    next_checkpoint: float = 0.0
    paused_until: float = 0.0
    node_seconds: float = 0.0
    fatal: int = 0
    redos: int = 0              # iterations abandoned and redone from another pipeline's copies
    preemptions: int = 0
    timeline: list = field(default_factory=list)  # (time, nodes, samples/s)

    def pause(self, seconds: float) -> None:
        """Stop training for `seconds` more, from now or from the end of a pause under way."""
        self.paused_until = max(self.paused_until, self.t) + seconds

    def checkpoint(self) -> None:
        self.saved = self.samples

    def rewind(self) -> None:
        """A fatal failure: the work since the last checkpoint is gone."""
        self.fatal += 1
        self.samples = self.saved


def summary(strategy, preemptions, fatal, mean_nodes, samples, horizon, cost_per_hour, hours, timeline) -> dict:
    """The result of a run; value is samples per second per dollar per hour."""
    throughput = samples / horizon if horizon else 0.0
    return {"strategy": strategy, "hours": round(hours, 3), "preemptions": preemptions, "fatal_failures": fatal,
            "mean_nodes": round(mean_nodes, 3), "throughput": round(throughput, 4),
            "cost_per_hour": round(cost_per_hour, 3),
            "value": round(throughput / cost_per_hour, 5) if cost_per_hour else 0.0,
            "samples": round(samples), "timeline": [(round(t, 1), n, round(r, 4)) for t, n, r in timeline]}
