"""Checkpoint copies in host memory, so that a rollback needs neither storage nor
a relaunch.

At every checkpoint each owner in pipeline 0 keeps the bytes it writes to storage
(the write goes on behind) and sends each stage's to one more node, its holder,
over a gloo group of the nodes taking part (opened once per epoch and member set,
at `protocol.copies_store`). A stage's holder is neither its owner nor either of its
neighbours in pipeline 0 (the owner of s - 1, whose node keeps s's replica, and the
owner of s + 1), so that two neighbours killed at once, whichever, leave a copy
of every stage: the first such node along pipeline 0 after s + 1, cyclically, then
the other pipelines' nodes, one in another zone than the owner's first, and in a
third zone, neither the owner's nor its replica holder's, when there is one: a
burst of those two zones then leaves the copy. A lone pipeline of three stages
has none: its writers alone keep copies.

Each node records what it keeps under COPIES(node) (iteration, layers), replaced at
every checkpoint and deleted when its worker starts or parks; a node keeps the
newest only. The agents roll back from memory when the live nodes' copies of one
iteration cover every layer (`newest_covered`); the handover then takes every
member's layers from them (`MemoryCopies.held`, bamboo/state/handover.py).
"""
from __future__ import annotations

import sys
import time

from schedules.layout import Layout

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import COPIES, ZONES, Copies, copies_store
from bamboo.state.handover import execute
from bamboo.transport.groups import open_group

Move = tuple[int, int, int]  # (layer, source, destination)


def holders(assignment: Assignment, failed, zones: dict[int, str]) -> list[tuple[int, int, int | None]]:
    """(stage, owner, holder) for each stage of pipeline 0 once `failed` died: who
    writes its checkpoint layers and who keeps the second copy (None: nobody can)."""
    pipe, dead = assignment.pipelines[0], {int(n) for n in failed}
    P = len(pipe)
    layout = Layout(P, frozenset(assignment.local_failed(0, dead)))
    node_at = [pipe[layout.owner(s)] for s in range(P)]
    others = [n for p in assignment.pipelines[1:] for n in p]
    out = []
    for s in range(P):
        near = {node_at[(s + d) % P] for d in (-1, 0, 1)}
        order = [pipe[(s + k) % P] for k in range(2, P)] + others
        candidates = list(dict.fromkeys(n for n in order if n not in near and n not in dead))
        away = [n for n in candidates if zones.get(n) != zones.get(node_at[s])]
        apart = [n for n in away if zones.get(n) != zones.get(node_at[(s - 1) % P])]  # nor the replica's zone
        out.append((s, node_at[s], (apart or away or candidates or [None])[0]))
    return out


def plan(assignment: Assignment, failed, zones: dict[int, str], layers_of) -> list[Move]:
    """The checkpoint copies' moves, the same on every node: each layer of each
    stage of pipeline 0 from its owner to its holder (`layers_of(stage)`: its layers)."""
    return [(layer, owner, holder) for stage, owner, holder in holders(assignment, failed, zones)
            if holder is not None for layer in sorted(layers_of(stage))]


def held(records: dict, nodes, iteration: int) -> dict[int, set[int]]:
    """node -> the layers of the checkpoint taken before `iteration` it keeps, for `nodes`."""
    nodes = set(nodes)
    return {n: set(r.layers) for n, r in records.items() if n in nodes and r.iteration == iteration}


def newest_covered(records: dict, nodes, layers: int, at_most: int) -> int | None:
    """The newest iteration, `at_most` at the latest, whose checkpoint the copies
    of `nodes` cover layer by layer (COPIES records: node -> Copies), or None."""
    for it in sorted({r.iteration for r in records.values() if r.iteration <= at_most}, reverse=True):
        if set().union(*held(records, nodes, it).values()) >= set(range(layers)):
            return it
    return None


class MemoryCopies:
    """The checkpoint copies one worker keeps, and its part in moving them."""

    def __init__(self, cluster: Cluster, node: int, timeout: float, max_bytes=None):
        """`max_bytes(layer)`: the most a copy received from a peer may announce."""
        self.cluster, self.node, self.timeout, self.max_bytes = cluster, node, timeout, max_bytes
        self.iteration: int | None = None
        self.blobs: dict[int, bytes] = {}          # layer -> snapshot bytes, of checkpoint `iteration`
        self.seconds = 0.0                         # the last exchange took
        self._group: tuple[str, object, dict] | None = None  # (store key, group, rank of node)
        self._broken: str | None = None            # a group whose exchange failed: not used again
        cluster.delete(COPIES(node))  # an earlier worker's copies went with it

    def drop(self) -> None:
        if self.iteration is not None:
            self.iteration, self.blobs = None, {}
            self.cluster.delete(COPIES(self.node))

    def take(self, iteration: int, assignment: Assignment, failed, own: dict[int, bytes] | None, layers_of,
             loss_scale, lease_check) -> None:
        """The checkpoint taken before `iteration`: keep `own` (the layers this node
        writes, if any), send them to their holders, keep what comes, forget the
        older copies. Every node of the epoch calls it at the same boundary.
        A death on the way leaves this node with its own layers only."""
        began = time.monotonic()
        moves = plan(assignment, failed, {n: z.zone for n, z in self.cluster.children(ZONES()).items()}, layers_of)
        members = sorted({n for _, src, dst in moves for n in (src, dst)})
        blobs = dict(own or {})
        if self.node in members:
            blobs.update(self._exchange(assignment.epoch, members, moves, blobs, lease_check))
        if not blobs:
            self.drop()
            return
        self.iteration, self.blobs = iteration, blobs
        self.cluster.put(COPIES(self.node), Copies(iteration, tuple(sorted(blobs)),
                                                   loss_scale.to_dict() if loss_scale else None))
        self.seconds = time.monotonic() - began

    def _exchange(self, epoch: int, members: list[int], moves: list[Move], own: dict[int, bytes],
                  lease_check) -> dict[int, bytes]:
        key = copies_store(epoch, members)
        if key == self._broken:
            return {}
        give_up = lease_check(members)
        try:
            if self._group is None or self._group[0] != key:
                pg, rank_of, _ = open_group(self.cluster, key, members, self.node, give_up, self.timeout)
                self._group = (key, pg, rank_of)
            _, pg, rank_of = self._group
            return execute(pg, rank_of, self.node, moves, own.__getitem__, give_up, self.max_bytes)
        except (RuntimeError, TimeoutError) as e:  # gloo's error for a dead peer, or a wait given up
            print(f"bamboo.state.copies: node {self.node}: checkpoint copies not exchanged: "
                  f"{str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
            self._group, self._broken = None, key
            return {}

    def held(self, new: Assignment, old: Assignment | None) -> dict[int, set[int]]:
        """node -> the layers of the checkpoint `new` starts from that it keeps, for
        the live nodes that take part in moving to `new` (the agents' choice)."""
        nodes = (set(old.members) if old else set()) | set(new.members)
        return held(self.cluster.children(COPIES()), nodes - set(new.gone), new.start)

    def loss_scale(self, iteration: int) -> dict | None:
        """fp16: the loss scale record kept with the copies of checkpoint `iteration`."""
        return next((r.loss_scale for r in self.cluster.children(COPIES()).values()
                     if r.iteration == iteration and r.loss_scale is not None), None)
