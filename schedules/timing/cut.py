"""The maximal cut, by counting messages: how far every node's stream runs when one
node stops before its instruction k.

A node runs until it reaches a receive whose message its sender never sent, so the
cut depends on which sends happen, not on when. For each channel, `Matches` keeps
where in the sender's stream each message is sent and where in the receiver's it
is taken; then a node's cut is its first receive whose message lies at or past its
sender's cut. The cuts are found by lowering them from the streams' ends until none
moves (the greatest fixpoint, which is what running every node as far as it can
reaches). That costs a few bisections per node, so the tables, one pass over the
streams, are what is worth building once per schedule (compiler.py caches them):
a recovery plan no longer runs the whole iteration in the engine to find its cut.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import NamedTuple

from schedules.ir import RECVS, SENDS, Instr, channel


class Inbound(NamedTuple):
    """One channel into a node: its sender, where each message leaves the sender's
    stream and where the receiver takes it, in order."""
    src: int
    sent_at: list[int]
    taken_at: list[int]


class Matches:
    """Every node's inbound channels of a set of (valid) streams."""

    def __init__(self, streams: dict[int, list[Instr]]):
        sent: dict[tuple, list[int]] = defaultdict(list)
        taken: dict[tuple, list[int]] = defaultdict(list)
        for node, stream in streams.items():
            for pc, ins in enumerate(stream):
                if ins.op in SENDS:
                    sent[channel(ins, node)].append(pc)
                elif ins.op in RECVS:
                    taken[channel(ins, node)].append(pc)
        self.length = {n: len(s) for n, s in streams.items()}
        self.inbound: dict[int, list[Inbound]] = {n: [] for n in streams}
        self.outbound: dict[int, set[int]] = {n: set() for n in streams}
        for (src, dst, op), at in taken.items():
            self.inbound[dst].append(Inbound(src, sent.get((src, dst, op), []), at))
            self.outbound[src].add(dst)

    def talk(self, a: int, b: int) -> bool:
        """Whether nodes a and b send each other anything."""
        return b in self.outbound[a] or a in self.outbound[b]

    def cut(self, dead: int, before: int) -> dict[int, int]:
        """How many instructions each node runs when `dead` runs only its first
        `before` (it may stop earlier, on a receive that never comes)."""
        pcs = dict(self.length)
        pcs[dead] = before
        todo = set(pcs)
        while todo:
            node = todo.pop()
            pc = self._blocked_at(node, pcs)
            if pc < pcs[node]:
                pcs[node] = pc
                todo |= self.outbound[node]
        return pcs

    def _blocked_at(self, node: int, pcs: dict[int, int]) -> int:
        """The node's cut given its senders' cuts: its first receive whose message
        is sent at or past the sender's cut, or its cut as it stands."""
        pc = pcs[node]
        for src, sent_at, taken_at in self.inbound[node]:
            arrived = bisect_left(sent_at, pcs[src])  # messages sent before the sender's cut
            if arrived < len(taken_at) and taken_at[arrived] < pc:
                pc = taken_at[arrived]
        return pc

