"""The compiler on the pause path at fleet scale: how long a worker waits for the
streams of a new epoch (compiled, or served from the cache), and for the recovery
plan after one death.

For one pipeline of P stages and M microbatches (eager, the default options and
cost model) it prints the time to compile the fault-free streams, to serve them
again from the cache, to build the message tables a recovery starts from (once
per schedule, kept with it), and to compile the recovery plan for deaths spread
over the nodes and the iteration (each a cache miss: a new death).

    python scripts/bench_compile.py [--stages 64] [--microbatches 512] [--deaths 12] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from schedules.compiler import compile_recovery, compile_schedule  # noqa: E402
from schedules.cost import CostModel  # noqa: E402
from schedules.options import ScheduleOptions  # noqa: E402
from schedules.timing.cut import Matches  # noqa: E402


def timed(call) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def deaths(schedule, count: int, seed: int) -> list[tuple[int, int]]:
    """(node, instruction before which it dies): early, middle and late in the
    iteration, on nodes across the pipeline."""
    rng, nodes = random.Random(seed), sorted(schedule.streams)
    points = []
    for i in range(count):
        node = nodes[(i * 7919) % len(nodes)]
        length = len(schedule.streams[node])
        points.append((node, rng.randrange(length * (i % 3) // 3, length * (i % 3 + 1) // 3 + 1)))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=512)
    ap.add_argument("--deaths", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.stages < 2 or a.microbatches < 1 or a.deaths < 1:
        ap.error("--stages must be at least 2, --microbatches and --deaths at least 1")
    options, cost = ScheduleOptions(redundancy="eager"), CostModel()
    print(f"P={a.stages} M={a.microbatches} redundancy eager, default options and cost model; "
          f"{a.deaths} deaths, seed {a.seed}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    compiled, schedule = timed(lambda: compile_schedule(a.stages, a.microbatches, (), options, cost))
    served = min(timed(lambda: compile_schedule(a.stages, a.microbatches, (), options, cost))[0] for _ in range(5))
    tables, _ = timed(lambda: Matches(schedule.streams))  # what the compiler builds once and keeps
    print(f"fault-free streams: compiled {compiled:.3f} s ({sum(map(len, schedule.streams.values()))} "
          f"instructions); served from the cache {served:.4f} s; message tables {tables:.3f} s (once)")
    times = []
    for node, before in deaths(schedule, a.deaths, a.seed):
        took, _ = timed(lambda: compile_recovery(a.stages, a.microbatches, node, before, (), options, cost))
        times.append(took)
        print(f"  node {node:>3} dies before instruction {before:>5}: recovery plan {took:.3f} s")
    print(f"recovery plan: median {statistics.median(times):.3f} s, max {max(times):.3f} s over {len(times)} deaths")


if __name__ == "__main__":
    main()
