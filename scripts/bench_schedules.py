"""Schedule compiler benchmark: simulated cost of eager FRC, and compile speed.

Prints, for P in {4, 8} and M in {8, 16, 32}, the simulated iteration time of
eager FRC in the bubbles (--frc bubbles) and for every microbatch (--frc all),
each divided by the same schedule without redundancy, and --frc all's divided by
a lower bound: max(no-RC makespan, the busiest node's total work with RC), i.e.
the no-RC makespan plus whatever redundant work cannot fit in that node's
bubbles. Also the share of microbatches the bubbles hold FRC for (mean over the
nodes), peak live activations, and the median time to compile P=32, M=128 for
all stages (target: under 50 ms) in both placements.

    python scripts/bench_schedules.py [--forward 1 --backward 2 --transfer 0.05 --swap 0.05]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

from schedules.compiler import compile_schedule, simulate
from schedules.cost import CostModel
from schedules.options import ScheduleOptions


def lower_bound(off_report, eager_report) -> float:
    """No schedule beats the plain one, and no node finishes before all its own
    work (normal, FRC, swaps, replica step) is done."""
    return max([off_report.makespan] + list(eager_report.busy.values()))


def compile_speed(frc: str, repeats: int = 15) -> list[float]:
    times = []
    for i in range(repeats):
        cost = CostModel(transfer=0.05 + i * 1e-9)  # a new cache key: really compile
        t0 = time.perf_counter()
        compile_schedule(32, 128, options=ScheduleOptions(frc=frc), cost=cost)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forward", type=float, default=1.0)
    ap.add_argument("--backward", type=float, default=2.0)
    ap.add_argument("--transfer", type=float, default=0.05)
    ap.add_argument("--swap", type=float, default=0.05)
    args = ap.parse_args()
    for flag in ("forward", "backward", "transfer", "swap"):
        value = getattr(args, flag)
        least = "above 0" if flag in ("forward", "backward") else "not negative"
        if not math.isfinite(value) or value < 0 or (least == "above 0" and value == 0):
            ap.error(f"--{flag} must be a finite number {least} (got {value})")
    cost = CostModel(forward=args.forward, backward=args.backward, transfer=args.transfer, swap=args.swap)
    print(f"cost model: forward {args.forward}, backward {args.backward}, transfer {args.transfer}, "
          f"swap {args.swap} (per stage and microbatch)")
    print(f"{'P':>3} {'M':>4} {'off':>8} {'bubbles':>8} {'all':>8} {'bubbles/off':>12} {'all/off':>8} "
          f"{'all/bound':>10} {'FRC held':>9} {'peak live off':>14} {'all':>4} {'swapped':>8}")
    for P in (4, 8):
        for M in (8, 16, 32):
            off = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy="off"), cost=cost), cost)
            bounded = compile_schedule(P, M, cost=cost)
            r_bounded = simulate(bounded, cost)
            r_all = simulate(compile_schedule(P, M, options=ScheduleOptions(frc="all"), cost=cost), cost)
            held = statistics.mean(len(bounded.frc_microbatches(n)) / M for n in bounded.streams)
            print(f"{P:>3} {M:>4} {off.makespan:>8.2f} {r_bounded.makespan:>8.2f} {r_all.makespan:>8.2f} "
                  f"{r_bounded.makespan / off.makespan:>12.3f} {r_all.makespan / off.makespan:>8.3f} "
                  f"{r_all.makespan / lower_bound(off, r_all):>10.3f} {held:>9.2f} "
                  f"{max(off.peak_live.values()):>14} {max(r_all.peak_live.values()):>4} "
                  f"{max(r_all.peak_swapped.values()):>8}")
    for frc in ("bubbles", "all"):
        times = compile_speed(frc)
        print(f"compile P=32 M=128 --frc {frc}, all stages: median {statistics.median(times) * 1e3:.1f} ms, "
              f"best {min(times) * 1e3:.1f} ms over {len(times)} runs (target < 50 ms)")


if __name__ == "__main__":
    main()
