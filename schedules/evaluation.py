"""Pass (g): forward-only evaluation streams (the validation loss after a step).

Every group runs the forwards of its stages for each evaluation microbatch, in
order: it loads the microbatch (first stage; the last stage for its labels when
it does not hold stage 0), receives its input activation, and sends its output
on. No backward, reduce, step or sync: parameters are left as they are. The last
stage's forward ends in the loss. A node with two groups (node P-1 after node 0
failed) gets one stream from both by list scheduling in the engine, which
validates every stream as it runs them.
"""
from __future__ import annotations

from schedules.cost import CostModel
from schedules.timing.engine import Chains, Engine
from schedules.layout import Layout
from schedules.lower import lower_group


def eval_streams(layout: Layout, microbatches: int, cost: CostModel | None = None) -> dict:
    """{node: its evaluation stream} for every live node of `layout`."""
    forwards = [("F", mb) for mb in range(microbatches)]
    per_node: dict[int, list] = {}
    for group in layout.groups():
        per_node.setdefault(group.node, []).append(lower_group(layout, group, forwards))
    fixed = {n: bodies[0] for n, bodies in per_node.items() if len(bodies) == 1}
    multi = {n: Chains([], bodies, []) for n, bodies in per_node.items() if len(bodies) > 1}
    report = Engine(layout, microbatches, cost, evaluation=True).run(fixed, multi)
    return {n: report.streams[n] for n in sorted(per_node)}
