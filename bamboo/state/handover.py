"""Moving layers between nodes when the configuration changes (between iterations).

Every live node knows, from the previous assignment and the failed set, which
layers each node holds up to date, and from the next assignment which layers each
node needs. (With --replica-sync next a replica is a step behind at a boundary, so
it is not up to date: every replica of the new epoch is sent by its stage's owner,
and the new epoch's first iteration owes no sync.) The plan is the same on every
node: each missing (node, layer) pair is sent by a holder, spreading the sends over
holders. Parameters and AdamW state
travel together, serialised as a checkpoint layer is, over a gloo group of every
node that sends or receives.

A participant may die at any moment of it. Each one that got and sent all its
layers marks HANDED; the first node to see every mark, or to see a participant
gone without one, writes the outcome (HANDOVER), which every node then reads: on
"complete" all enter the new epoch, on "failed" none does, all keep the layers
they had, and the agents write another epoch from those (Assignment.layers_from).

A rollback from memory (Assignment.restore "memory") is the same handover with
other sources: the checkpoint copies the live nodes keep (bamboo/state/copies.py),
from which every member takes every layer it needs, its own copy's bytes or a peer's.
"""
from __future__ import annotations

import torch

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import HANDED, HANDOVER, Mark, Outcome, handover_store
from bamboo.state.checkpoint import snapshot
from bamboo.transport.groups import interruptible, open_group

_TAG = 1000  # clear of the executor's channel tags


class HandoverFailed(Exception):
    """A participant died during the handover: no node enters the new epoch."""


class LayerLost(Exception):
    """A layer some node needs is held by no live node: the agents should have
    restored from a checkpoint (not a RuntimeError, which a dead peer's gloo raises)."""

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


class OversizedLayer(ValueError):
    """A peer announced more bytes for a layer than its snapshot can take."""


def execute(pg, rank_of: dict[int, int], me: int, moves: list[tuple[int, int, int]],
            blob_of, give_up=lambda: None, max_bytes=None) -> dict[int, bytes]:
    """Run this node's part of `moves`: send what it holds (`blob_of(layer)`: the
    layer's snapshot bytes, parameters and optimizer state), return what it
    received (layer -> snapshot bytes). Each wait ends early with RendezvousAborted
    when `give_up()` names a reason (a paused peer never closes its socket).
    `max_bytes(layer)`: the most a received layer may announce (OversizedLayer)."""
    works, keep = [], []
    for layer, src, dst in moves:
        if src == me:
            data = torch.frombuffer(bytearray(blob_of(layer)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            keep += [size, data]
            works.append(pg.send([size], rank_of[dst], _TAG + layer))
            works.append(pg.send([data], rank_of[dst], _TAG + layer))
    received = {}
    for layer, src, dst in moves:
        if dst == me:
            size = torch.zeros(1, dtype=torch.int64)
            interruptible(pg.recv([size], rank_of[src], _TAG + layer).wait, give_up)
            limit = max_bytes(layer) if max_bytes else None
            if not 0 < int(size) <= (limit or int(size)):
                raise OversizedLayer(f"node {src} announced {int(size)} bytes for layer {layer} "
                                     f"(a snapshot of it takes at most {limit})")
            data = torch.empty(int(size), dtype=torch.uint8)
            interruptible(pg.recv([data], rank_of[src], _TAG + layer).wait, give_up)
            received[layer] = data.numpy().tobytes()
    for w in works:  # a gloo send or receive completes only inside wait(): see interruptible
        interruptible(w.wait, give_up)
    return received


def live_layers(holdings):
    """The bytes a node sends of a layer it runs: its snapshot now."""
    return lambda layer: snapshot({layer: holdings.layers[layer]}, holdings.optimizer_of(layer))[layer]


def sources(new: Assignment, old: Assignment, mode: str, late: bool) -> dict[int, set[int]]:
    """node -> the stages it can send for `new`: those it holds up to date after
    `old` (alive, not gone). With --replica-sync next (`late`) a replica is a
    source only where `new.taken` says (None: every replica is); the agents judged
    what is lost from the same (agents/membership.py `lost_everywhere`)."""
    taken = new.taken if late else None
    return {n: stages for n, stages in old.holders(new.failed, mode, taken).items() if n not in new.gone}


def exchange(cluster: Cluster, node: int, holdings, new: Assignment, old: Assignment | None,
             lease_check, timeout: float, copies=None) -> dict[int, bytes]:
    """This node's part in moving layers to `new`'s members from the live nodes
    that hold them after `old` (its `holdings` send and keep what they can); returns
    what it received, or raises HandoverFailed. `lease_check(members, starting)`
    tells when a member can no longer come; `timeout` bounds each wait. With
    `copies` (a rollback from memory, bamboo/state/copies.py) the sources are the
    checkpoint copies the live nodes keep, and every layer a member needs comes
    from them (its own copy, or a peer's), none from the layers it runs."""
    if copies is None:
        live = sources(new, old, holdings.mode(old), holdings.cfg.schedule.late_in(old)).items() if old else ()
        have = {n: holdings.layers_of(old.depth, stages) for n, stages in live}
    else:
        have = copies.held(new, old)
    need = {n: holdings.needs(new, n) for n in new.members}
    members = sorted(set(need) | set(have))
    why_not = lease_check(members, set(need) - set(have))

    def give_up() -> str | None:
        outcome = cluster.get(HANDOVER(new.epoch))
        return f"the handover failed: {outcome.why}" if outcome and not outcome.complete else why_not()
    if node not in members:
        return {}  # a standby node with no layer to give: nothing to take part in
    try:
        moves = plan(have, need)
    except LayerLost as e:
        if copies is None:
            raise
        cluster.create(HANDOVER(new.epoch), Outcome(False, f"the copies in memory: {e}"))  # a holder died since
        raise HandoverFailed(str(e)) from None
    received = None
    try:
        pg, rank_of, _ = open_group(cluster, handover_store(new.epoch), members, node, give_up, timeout)
        received = execute(pg, rank_of, node, moves, copies.blobs.__getitem__ if copies else live_layers(holdings),
                           give_up, holdings.blob_bound)
        interruptible(pg.barrier().wait, give_up)  # every layer arrived before a sender may leave
        cluster.put(HANDED(new.epoch, node), Mark())
    except (RuntimeError, TimeoutError) as e:  # gloo's error for a dead peer, or a wait given up
        why_not()  # records whoever went silent
        cluster.create(HANDOVER(new.epoch), Outcome(False, f"node {node}: {str(e).splitlines()[0][:200]}"))
    outcome = cluster.wait_for(lambda: _settle(cluster, new.epoch, members, why_not), timeout=timeout,
                               what=f"the outcome of epoch {new.epoch}'s handover")
    if not outcome.complete:
        raise HandoverFailed(outcome.why)
    if received is None:  # complete needs this node's own mark: it cannot have failed here
        raise RuntimeError(f"node {node}: epoch {new.epoch}'s handover is complete without this node's part")
    if copies is not None:  # the layers it needs and keeps a copy of: its own bytes
        received.update({i: copies.blobs[i] for i in need.get(node, set()) & have.get(node, set())})
    return received


def _settle(cluster: Cluster, epoch: int, members: list[int], why_not) -> Outcome | None:
    """The handover's outcome once decided; decide it when every member marked
    HANDED (complete) or one went silent without (failed)."""
    outcome = cluster.get(HANDOVER(epoch))
    if outcome is None:
        handed = cluster.children(HANDED(epoch))
        if all(n in handed for n in members):
            cluster.create(HANDOVER(epoch), Outcome(True))
        elif reason := why_not():
            missing = [n for n in members if n not in handed]
            cluster.create(HANDOVER(epoch), Outcome(False, f"{reason}; no mark from {missing}"))
        outcome = cluster.get(HANDOVER(epoch))
    return outcome
