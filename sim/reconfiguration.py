"""What a reconfiguration loses and costs, shared by the strategies and by `auto`:
which nodes changed stage, which stages died in each pipeline, which are lost on
every node, and how long one stage's state takes to move."""
from __future__ import annotations

from schedules.layout import Layout

from agents.policy import Config
from sim.profiles import NETWORK, Profile


def stages_moved(a: Config, b: Config) -> bool:
    """Whether any node of `b` computes a different stage than it did in `a`."""
    before = {n: s for pipe in a.pipelines for s, n in enumerate(pipe)}
    return any(before.get(n) != s for pipe in b.pipelines for s, n in enumerate(pipe))


def dead_stages(config: Config, removed: set[str]) -> list[set[int]]:
    """The stage positions that died in each pipeline of `config`."""
    return [{i for i, n in enumerate(pipe) if n in removed} for pipe in config.pipelines]


def lost_everywhere(depth: int, deaths: list[set[int]]) -> frozenset[int]:
    """Stages with no live copy in any pipeline: lost in each one (`deaths`: the
    stage positions that died in each pipeline)."""
    if not deaths:
        return frozenset()
    return frozenset.intersection(*(Layout.lost(depth, dead) for dead in deaths))


def handover_seconds(profile, depth: int) -> float:
    """Moving one stage's state (weights and optimizer) to its new node."""
    if isinstance(profile, Profile):
        return profile.stage_state_bytes(depth) * 2 / NETWORK
    return profile.handover_ms / 1000
