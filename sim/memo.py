"""What the simulator asks again and again, kept with the inputs it came from.

On a fleet of a thousand nodes one batch of trace events asks the agents' policy
for several configurations (the reaction, each burst the standby is weighed
against, the configuration with the free nodes) and most batches change none of
their inputs: a node that joins the free capacity leaves the job's nodes and
pipelines as they were. Each answer is kept with a copy of its inputs and given
again only where they are equal, so a run gives the same figures with or without
it (tests/unit/sim/test_sim_scale.py replays traces both ways).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Hashable, Mapping

from agents.policy import Config

KEPT = 256  # answers kept per table; a full table starts again (the trace has moved on)
SLOT = 4    # answers kept for one previous configuration and count of live nodes: the newest


def content(config: Config | None, live: Mapping[str, str]) -> tuple | None:
    """What the policy reads of a previous configuration: its depth, its pipelines
    and, of its standby, the nodes still live, in order (not its epoch)."""
    if config is None:
        return None
    return config.depth, config.pipelines, tuple(n for n in config.standby if n in live)


class PolicyMemo:
    """The policy's configurations, by the live nodes (compared as dicts: node ->
    zone) and `key` (the previous configuration's content and whatever else the
    call depends on). An answer given again takes the epoch its call would give."""

    def __init__(self) -> None:
        self._table: dict[tuple, list[tuple[dict[str, str], Config]]] = {}

    def get(self, live: Mapping[str, str], previous: Config | None, key: Hashable,
            plan: Callable[[], Config]) -> Config:
        slot = (content(previous, live), key, len(live))
        for seen, answer in self._table.get(slot, ()):
            if seen == live:
                epoch = previous.epoch + 1 if previous else 0
                return answer if answer.epoch == epoch else replace(answer, epoch=epoch)
        answer = plan()
        if len(self._table) >= KEPT:
            self._table.clear()
        seen = self._table.setdefault(slot, [])
        seen.append((dict(live), answer))
        del seen[:-SLOT]
        return answer


class Table:
    """A pure function's values by their (hashable) arguments, at most `kept` of them."""

    def __init__(self, compute: Callable[..., object], kept: int = KEPT) -> None:
        self._compute, self._values, self._kept = compute, {}, kept

    def __call__(self, *args):
        try:
            return self._values[args]
        except KeyError:
            if len(self._values) >= self._kept:
                self._values.clear()
            value = self._values[args] = self._compute(*args)
            return value


class ByKey:
    """Values computed from inputs too large to key by, kept by a smaller key that
    determines them (the caller says why it does): `get(key, compute)`."""

    def __init__(self, kept: int = 1 << 14) -> None:
        self._values: dict[Hashable, object] = {}
        self._kept = kept

    def get(self, key: Hashable, compute: Callable[[], object]):
        try:
            return self._values[key]
        except KeyError:
            if len(self._values) >= self._kept:
                self._values.clear()
            value = self._values[key] = compute()
            return value


class ByIdentity:
    """A pure function's values of a large immutable argument (a configuration's
    pipelines: a thousand nodes' worth to hash at every look-up), kept by the
    argument's identity for the few in force. A kept argument is held, so that its
    id is not another's meanwhile."""

    def __init__(self, compute: Callable[[object], object], kept: int = 16) -> None:
        self._compute, self._kept = compute, kept
        self._values: dict[int, tuple[object, object]] = {}

    def __call__(self, arg):
        found = self._values.get(id(arg))
        if found is not None and found[0] is arg:
            return found[1]
        if len(self._values) >= self._kept:
            self._values.clear()
        value = self._compute(arg)
        self._values[id(arg)] = (arg, value)
        return value


class Kept(dict):
    """A one-argument pure function's values by argument, at most `kept` of them:
    a dict, so that `map(kept.__getitem__, args)` looks each up in C."""

    def __init__(self, compute: Callable[[Hashable], object], kept: int = KEPT) -> None:
        super().__init__()
        self._compute, self._kept = compute, kept

    def __missing__(self, arg: Hashable):
        if len(self) >= self._kept:
            self.clear()
        value = self[arg] = self._compute(arg)
        return value
