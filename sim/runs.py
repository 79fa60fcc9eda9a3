"""Each strategy's run over one trace, timed, and with `bamboo-sim --jobs N` (by
default one per CPU) in N processes of their own: the strategies share nothing but
the trace, and on a fleet's month each keeps a core busy for a while. A run gives
the same figures in a process of its own as one after another (what the simulator
keeps between runs is caches of pure results).

Two processes take auto with bamboo, and lazy with the rest: auto times eager's
schedules first, which bamboo then finds timed, and the two halves take about as
long (a month of 1,000 nodes: docs/performance.md). More processes take one
strategy at a time, the longest first."""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Callable

# The longest first: two passes and every mode's schedules (auto), two passes, one pass.
ORDER = ("auto", "bamboo", "lazy", "redo", "checkpoint", "on-demand")
WITH_AUTO = ("auto", "bamboo")  # with two processes, the first one's

_task: Callable[[str], object] | None = None  # the run of one strategy, as forked workers inherit it


def _timed(strategies: list[str]) -> list[tuple[str, object, float]]:
    done = []
    for strategy in strategies:
        start = time.perf_counter()
        out = _task(strategy)
        done.append((strategy, out, round(time.perf_counter() - start, 2)))
    return done


def shares(strategies: list[str], jobs: int) -> list[list[str]]:
    """What each task runs, one strategy after another: all of them in one; in two,
    auto with bamboo and lazy with the others; else one strategy each, the longest
    first."""
    ranked = sorted(strategies, key=lambda s: ORDER.index(s) if s in ORDER else -1)
    if jobs <= 1:
        return [ranked]
    if jobs == 2:
        first = [s for s in ranked if s in WITH_AUTO]
        return [part for part in (first, [s for s in ranked if s not in first]) if part]
    return [[s] for s in ranked]


def jobs_of(value: str) -> int:
    """`--jobs`: a count of at least 1, or auto: the CPUs this process may run on."""
    if value == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--jobs must be at least 1, or auto (got {value})")
    return int(value)


def run_each(task: Callable[[str], object], strategies: list[str], jobs: int) -> dict[str, tuple[object, float]]:
    """strategy -> (task(strategy), its seconds), in the order of `strategies`; with
    `jobs` above 1, in that many forked processes (where the platform forks;
    elsewhere one after another)."""
    global _task
    _task = task
    parts = shares(strategies, jobs if "fork" in multiprocessing.get_all_start_methods() else 1)
    try:
        if len(parts) <= 1:
            done = [d for part in parts for d in _timed(part)]
        else:
            with multiprocessing.get_context("fork").Pool(min(jobs, len(parts))) as pool:
                done = [d for part in pool.map(_timed, parts, chunksize=1) for d in part]
    finally:
        _task = None
    found = {strategy: (out, seconds) for strategy, out, seconds in done}
    return {s: found[s] for s in strategies}
