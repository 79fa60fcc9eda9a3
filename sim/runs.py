"""Each strategy's run over one trace, timed, and with `bamboo-sim --jobs N` up to N
of them at a time in processes of their own: the strategies share nothing but the
trace, and on a fleet's month each keeps a core busy for a while. A run gives the
same figures in a process of its own as in one after another (what the simulator
keeps between runs is caches of pure results)."""
from __future__ import annotations

import multiprocessing
import time
from typing import Callable

# The longest first, so that the last to start is a short one: two passes and
# every mode's schedules (auto), two passes (bamboo, lazy, redo), one pass.
ORDER = ("auto", "bamboo", "lazy", "redo", "checkpoint", "on-demand")

_task: Callable[[str], object] | None = None  # the run of one strategy, as forked workers inherit it


def _timed(strategy: str) -> tuple[object, float]:
    start = time.perf_counter()
    out = _task(strategy)
    return out, round(time.perf_counter() - start, 2)


def run_each(task: Callable[[str], object], strategies: list[str], jobs: int) -> dict[str, tuple[object, float]]:
    """strategy -> (task(strategy), its seconds), in the order of `strategies`; with
    `jobs` above 1, that many at a time in forked processes (where the platform
    forks; elsewhere one after another)."""
    global _task
    _task = task
    start = sorted(strategies, key=lambda s: ORDER.index(s) if s in ORDER else -1)
    try:
        if jobs <= 1 or len(strategies) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            done = {s: _timed(s) for s in start}
        else:
            with multiprocessing.get_context("fork").Pool(min(jobs, len(strategies))) as pool:
                done = dict(zip(start, pool.map(_timed, start, chunksize=1)))
    finally:
        _task = None
    return {s: done[s] for s in strategies}
