"""The bytes a job's workers sent, from their own counters, and the share that
crossed a zone: the ledger's network part.

Each iteration's report carries its node's payload bytes by kind since its worker
started. What a node sent between two of its reports is given to the epoch of the
later one, and where it went is read from that epoch's pipelines: activations to
the next stage's node, input gradients to the previous one's, replica syncs to the
node that keeps the stage's replica (the stage before, cyclically), a data-parallel
reduce to the same stage's nodes of the other pipelines (an equal share each; its
counter counts the stage's gradients once, of which a ring all-reduce over D
pipelines sends 2(D-1)/D). A share whose destination sits in another zone crossed one. Counters come from etcd:
values that are no count are skipped, kinds are bounded.
"""
from __future__ import annotations

import math
from collections import defaultdict

MAX_KINDS = 32      # a report naming more kinds is read up to these
MAX_KIND_CHARS = 40


def destinations(pipelines: tuple[tuple[int, ...], ...], node: int, kind: str) -> list[int]:
    """The nodes that `node`'s bytes of `kind` go to under `pipelines` (the node of
    every stage, per pipeline), each an equal share; [] where none is known."""
    for pipe in pipelines:
        stages = [s for s, n in enumerate(pipe) if n == node]
        if not stages:
            continue
        first, last = stages[0], stages[-1]
        if kind == "send_act":
            return [pipe[last + 1]] if last + 1 < len(pipe) else []
        if kind == "send_grad":
            return [pipe[first - 1]] if first > 0 else []
        if kind == "send_sync":
            return [pipe[(first - 1) % len(pipe)]]
        if kind == "reduce":
            return [other[s] for other in pipelines if other is not pipe for s in stages if s < len(other)]
        return []
    return []


def _counts(sent) -> dict[str, float]:
    """The report's counters that are counts (a kind named in text, a finite number at least 0)."""
    if not isinstance(sent, dict):
        return {}
    out = {}
    for kind, count in list(sent.items())[:MAX_KINDS]:
        if isinstance(kind, str) and len(kind) <= MAX_KIND_CHARS and isinstance(count, (int, float)) \
                and not isinstance(count, bool) and math.isfinite(count) and count >= 0:
            out[kind] = float(count)
    return out


class NetworkTally:
    """Bytes sent by kind, and of them those that crossed a zone, over the iterations kept."""

    def __init__(self):
        self.last: dict[int, dict[str, float]] = {}   # node -> its counters at its last report
        self.sent: dict[str, float] = defaultdict(float)
        self.crossed: dict[str, float] = defaultdict(float)

    def add(self, pipelines, node: int, sent, zones: dict) -> None:
        """`node`'s report `sent` (its counters) under an epoch of `pipelines`; `zones`: node -> Zone."""
        counts, before = _counts(sent), self.last.get(node, {})
        home = zones[node].zone if node in zones else None
        for kind, count in counts.items():
            delta = count - before.get(kind, 0.0)
            if delta <= 0:
                continue
            if kind == "reduce":  # on the wire: what a ring all-reduce over the pipelines sends
                delta *= 2 * (len(pipelines) - 1) / max(1, len(pipelines))
            self.sent[kind] += delta
            to = destinations(pipelines, node, kind)
            away = sum(n in zones and zones[n].zone != home for n in to) if home is not None else 0
            if away:
                self.crossed[kind] += delta * away / len(to)
        self.last[node] = {**before, **counts}

    def snapshot(self) -> dict:
        return {"sent": dict(self.sent), "crossed": dict(self.crossed)}
