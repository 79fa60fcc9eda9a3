"""Which path a set of simultaneous deaths takes: the rule the runtime, the agents and
the cluster simulator follow (docs/faults.md, "Which path a death set takes").

A configuration is a list of pipelines, each naming the node of every stage (a node
on two stages of a short pipeline appears twice). Deaths are node names.

1. In the iteration (`IN_ITERATION`): every pipeline lost at most one node, that node
   ran one stage, and its predecessor holds a replica of it (eager or lazy). The
   compiler plans a recovery from exactly one death per pipeline per iteration.
2. Otherwise the iteration is abandoned job-wide and redone. From the survivors
   (`PEERS`) when every stage still has a live copy somewhere: its owner, its
   replica's holder, or either in another pipeline.
3. Otherwise back to the newest checkpoint, every stage of it (the live stages are
   newer): from the copies survivors keep in memory (`MEMORY`) when they hold every
   stage's copy, else from storage (`STORAGE`).

With --replica-sync next a death in its window (before the owner's sync landed, or
after its reduce with D > 1) also leaves the holder's replica a step behind. With
two pipelines or more the holder borrows what it misses from another pipeline's
owner of the stage, if one is alive, and the death is absorbed in the iteration
(bamboo/runtime/lending.py); with one pipeline, between iterations, or where the
batch took that stage's owner in every pipeline, the stage counts as lost in that
pipeline (schedules/syncs.py).
"""
from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Sequence

from schedules.layout import Layout
from schedules.split import merged

IN_ITERATION, PEERS, MEMORY, STORAGE = "in_iteration", "redone_from_peers", "rolled_back_from_memory", \
    "rolled_back_from_storage"
PATHS = (IN_ITERATION, PEERS, MEMORY, STORAGE)

Pipeline = Sequence[Hashable]


def dead_positions(pipeline: Pipeline, dead: Iterable[Hashable]) -> frozenset[int]:
    """The stages of `pipeline` whose node died."""
    dead = set(dead)
    return frozenset(s for s, n in enumerate(pipeline) if n in dead)


def lost_in(pipeline: Pipeline, dead: Iterable[Hashable], replicas: bool) -> frozenset[int]:
    """Stages no live node of `pipeline` holds once `dead` died: without replicas the
    dead nodes' own; with them, those whose owner and predecessor both died. A node
    on two stages keeps no replica (its memory holds its two stages), so the
    compiler counts the merged stage as a failed node's."""
    hit = dead_positions(pipeline, dead)
    if not hit or not replicas:
        return hit
    return Layout.lost(len(pipeline), hit | merged(pipeline))


def absorbs(pipeline: Pipeline, dead: Iterable[Hashable], replicas: bool) -> bool:
    """Whether `pipeline` finishes the iteration in which `dead` died (rule 1)."""
    dead = set(dead)
    nodes = {n for n in pipeline if n in dead}
    if not nodes:
        return True
    return replicas and len(nodes) == 1 and not lost_in(pipeline, dead, replicas)


def lost_everywhere(pipelines: Sequence[Pipeline], dead: Iterable[Hashable], replicas: bool) -> frozenset[int]:
    """Stages with no live copy in any pipeline."""
    dead = set(dead)
    if not pipelines:
        return frozenset()
    return frozenset.intersection(*(lost_in(p, dead, replicas) for p in pipelines))  # none dead in p: none lost


def path(pipelines: Sequence[Pipeline], dead: Iterable[Hashable], replicas: bool,
         copies: Mapping[int, set] | None = None) -> str:
    """The path the deaths `dead` take (module docstring). `copies`: stage -> the nodes
    holding its newest checkpoint in memory (none: a rollback reads storage)."""
    dead = set(dead)
    if all(absorbs(p, dead, replicas) for p in pipelines):
        return IN_ITERATION
    if not lost_everywhere(pipelines, dead, replicas):
        return PEERS
    copies = copies or {}
    return MEMORY if all(copies.get(s, set()) - dead for s in range(len(pipelines[0]))) else STORAGE
