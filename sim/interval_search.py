"""`--checkpoint-formula best`: a spot strategy's checkpoints at the interval that
gives it the most value on this trace, searched rather than taken from a formula.

Daly's and Young's intervals are optimal for independent failures at a steady
rate; spot preemptions come in bursts, so a fixed interval can do better (or
worse). A baseline is given its best settings before anything is claimed to beat
it, so each candidate below is run over the whole trace, and the best one's run is
the result, with every candidate's value beside it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from sim.checkpointing import FORMULAS
from sim.options import Options

BEST = "best"
SEARCH_MINUTES = (1, 2, 5, 10, 20, 30, 60, 120)  # fixed intervals tried beside the formulas


def candidates(options: Options) -> dict[str, Options]:
    """The options of each interval tried, by name: each formula, then each fixed interval."""
    out = {formula: replace(options, checkpoint_formula=formula, checkpoint_seconds=None) for formula in FORMULAS}
    out.update({f"{m} min": replace(options, checkpoint_seconds=m * 60.0) for m in SEARCH_MINUTES})
    out["never"] = replace(options, checkpoint_seconds=math.inf)  # notices may save all there is to save
    return out


def best_run(run: Callable[[Options], dict], options: Options) -> dict:
    """`run`'s result at the interval of the most value (the formula's on a tie),
    with `checkpoint_search`: the interval chosen and every candidate's value."""
    results = {name: run(opts) for name, opts in candidates(options).items()}
    chosen = max(results, key=lambda name: (results[name]["value"], name in FORMULAS))
    return {**results[chosen], "checkpoint_search": {
        "chosen": chosen, "value_by_interval": {name: r["value"] for name, r in results.items()}}}
