"""Moving layers between nodes when the configuration changes (between iterations).

Every live node knows, from the previous assignment and the failed set, which
layers each node holds up to date, and from the next assignment which layers each
node needs. The plan is the same on every node: each missing (node, layer) pair is
sent by a holder, spreading the sends over holders. Parameters and AdamW state
travel together, serialised as a checkpoint layer is, over a gloo group of every
node that sends or receives.
"""
from __future__ import annotations

import torch

from bamboo.assignment import Assignment
from bamboo.checkpoint import snapshot
from bamboo.cluster import Cluster
from bamboo.groups import open_group
from bamboo.protocol import handover_store

_TAG = 1000  # clear of the executor's channel tags


class LayerLost(RuntimeError):
    """A layer some node needs is held by no live node."""

    def __init__(self, layers: list[int]):
        super().__init__(f"no live node holds layers {layers}")
        self.layers = layers


def plan(have: dict[int, set[int]], need: dict[int, set[int]]) -> list[tuple[int, int, int]]:
    """(layer, source, destination) for every layer a destination needs and lacks,
    in one order every node computes alike. Sources: the holder that has sent the
    fewest layers so far (ties: the lowest node id)."""
    holders: dict[int, list[int]] = {}
    for node, layers in have.items():
        for layer in layers:
            holders.setdefault(layer, []).append(node)
    lost = sorted({layer for node, layers in need.items() for layer in layers
                   if layer not in have.get(node, set()) and layer not in holders})
    if lost:
        raise LayerLost(lost)
    sent: dict[int, int] = {}
    out = []
    for dst in sorted(need):
        for layer in sorted(need[dst] - have.get(dst, set())):
            src = min(holders[layer], key=lambda n: (sent.get(n, 0), n))
            sent[src] = sent.get(src, 0) + 1
            out.append((layer, src, dst))
    return out


def execute(pg, rank_of: dict[int, int], me: int, moves: list[tuple[int, int, int]],
            layers: dict[int, torch.nn.Module], optimizer_of) -> dict[int, bytes]:
    """Run this node's part of `moves`: send what it holds (parameters and the
    optimizer state `optimizer_of(layer)` keeps for them), return what it received
    (layer -> snapshot bytes)."""
    works, keep = [], []
    for layer, src, dst in moves:
        if src == me:
            data = torch.frombuffer(bytearray(snapshot({layer: layers[layer]}, optimizer_of(layer))[layer]),
                                    dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            keep += [size, data]
            works.append(pg.send([size], rank_of[dst], _TAG + layer))
            works.append(pg.send([data], rank_of[dst], _TAG + layer))
    received = {}
    for layer, src, dst in moves:
        if dst == me:
            size = torch.zeros(1, dtype=torch.int64)
            pg.recv([size], rank_of[src], _TAG + layer).wait()
            data = torch.empty(int(size), dtype=torch.uint8)
            pg.recv([data], rank_of[src], _TAG + layer).wait()
            received[layer] = data.numpy().tobytes()
    for w in works:
        w.wait()
    return received


def exchange(cluster: Cluster, node: int, holdings, new: Assignment, old: Assignment | None,
             lease_check) -> dict[int, bytes]:
    """This node's part in moving layers to `new`'s members from the live nodes
    that hold them after `old` (its `holdings` send and keep what they can); returns
    what it received. `lease_check(members, starting)` gives up the group's
    rendezvous when a member can no longer come."""
    live = old.holders(new.failed, holdings.redundancy).items() if old else ()
    have = {n: holdings.layers_of(old.depth, stages) for n, stages in live if n not in new.gone}
    need = {n: holdings.needs(new, n) for n in new.members}
    members = sorted(set(need) | set(have))
    pg, rank_of, _ = open_group(cluster, handover_store(new.epoch), members, node,
                                lease_check(members, set(need) - set(have)))
    received = execute(pg, rank_of, node, plan(have, need), holdings.layers, holdings.optimizer_of)
    pg.barrier().wait()  # every layer arrived before a sender may leave
    return received
