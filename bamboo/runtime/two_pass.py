"""A backward in two passes: the gradient w.r.t. the stage's input first, the
weights' later (a split backward, schedules/early_grads.py).

The input pass runs the part of the autograd graph between the root and the
stage's input. On that path sit junctions: nodes whose backward also feeds a
weight. Each junction's incoming gradients are kept, and the weight pass starts
from them, so nothing is computed twice. The weights accumulate through their
AccumulateGrad nodes as in a whole backward: the same functions on the same
gradients give the same bits, and post-accumulate hooks fire (the replica sync's
buckets, bamboo/runtime/sync.py, use them). The idea is zero-bubble pipelining's
(Qi et al., 2024); torch.distributed.pipelining has its own, whose package would
add 0.7 s to every worker's start.
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node:
    """The node a gradient w.r.t. `t` flows into: its grad_fn, or a leaf's AccumulateGrad."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


class WeightsOwed:
    """What an input pass leaves for its weight pass: per group of weights, the
    junctions their gradients leave the input's path at, and what reached those."""

    def __init__(self, groups: list[tuple[list[Node], list[torch.Tensor]]], kept: dict[Node, tuple]):
        self.groups, self.kept = groups, kept

    def weight_pass(self) -> None:
        """Accumulate every group's weight gradients."""
        for junctions, params in self.groups:
            edges = [(GradientEdge(j, i), g) for j in junctions for i, g in enumerate(self.kept.get(j, ()))
                     if g is not None]
            if not edges:
                continue
            # a junction below another is reached from it too: its input is what it got
            # in the input pass, not that plus what the pass from above adds again
            handles = [j.register_prehook(lambda _, g=self.kept[j]: g) for j in junctions if j in self.kept] \
                if len(junctions) > 1 else []
            try:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.kept = [], {}


def input_pass(root: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor,
               params: list[torch.Tensor]) -> tuple[torch.Tensor, WeightsOwed]:
    """d root / d inp (with `grad` as root's gradient), and what the weight pass of
    `params` needs; the graph is kept until then."""
    parents = _parents(root.grad_fn)
    on_path, _ = _up(grad_node(inp), parents)  # the input pass's nodes
    groups = _junction_groups(params, parents, on_path)
    kept: dict[Node, tuple] = {}
    handles = [j.register_prehook(lambda g, j=j: kept.__setitem__(j, g)) for js, _ in groups for j in js]
    try:
        (dinp,) = torch.autograd.grad(root, inp, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dinp, WeightsOwed(groups, kept)


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root` -> the nodes whose backward feeds it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return parents


def _up(start: Node, parents: dict[Node, list[Node]], stop: set[Node] = frozenset()) -> tuple[set[Node], set[Node]]:
    """The nodes whose backward reaches `start` (itself included), not going past
    `stop`; and the `stop` nodes met on the way."""
    found, met, todo = {start}, set(), deque([start])
    while todo:
        for parent in parents.get(todo.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in found:
                found.add(parent)
                todo.append(parent)
    return found, met


def _junction_groups(params: list[torch.Tensor], parents: dict[Node, list[Node]],
                     on_path: set[Node]) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """The weights grouped so that no two groups share a junction, each group with
    its junctions: where its weights' branches leave the input's path."""
    group_of: dict[Node, int] = {}  # junction -> group index
    groups: list[tuple[set[Node], list[torch.Tensor]]] = []
    for p in params:
        acc = grad_node(p)
        if acc not in parents:
            continue  # not in this graph: no gradient, as in a whole backward
        _, junctions = _up(acc, parents, on_path)
        merged = {group_of[j] for j in junctions if j in group_of}
        target = min(merged) if merged else len(groups)
        if not merged:
            groups.append((set(), []))
        for other in sorted(merged - {target}, reverse=True):
            groups[target][0].update(groups[other][0])
            groups[target][1].extend(groups[other][1])
            groups[other] = (set(), [])
        groups[target][0].update(junctions)
        groups[target][1].append(p)
        for j in groups[target][0]:
            group_of[j] = target
    return [(list(js), ps) for js, ps in groups if ps]
