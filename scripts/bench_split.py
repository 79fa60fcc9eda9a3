"""Split backwards: what `--backward-split last` gains in time and costs in
memory against whole backwards (`off`), side by side.

Runs bamboo-train on the hot path's GPT (scripts/bench_hotpath.py: 3.3M parameters,
seq 128, P=2, M=8, batch 8, --redundancy off), alternating the two settings in
every round, and prints the geometric mean of the rounds' own ratios with its 95%
interval for the iteration time (warm-up iterations dropped) and each node's peak
RSS, beside what the schedule simulator counts: the iteration on the default cost
model and the most forward states each node holds at once. A split backward keeps
its microbatch's saved tensors for the weight pass one slot longer.

    python scripts/bench_split.py [--rounds 3] [--iterations 14] [--warm 5]
"""
from __future__ import annotations

import argparse
import statistics

from bench_hotpath import BATCH, CFG, ENV, M, MODEL, P, ROOT
from bench_runtime import run
from results import at_least, interval  # scripts/results.py, beside this file

from schedules.compiler import compile_schedule, simulate
from schedules.options import ScheduleOptions

SPLITS = ("last", "off")


def one_run(split: str, a) -> tuple[float, dict[int, float]]:
    """(mean iteration seconds after the warm-up, peak RSS in MB per node)."""
    records = run(["--model", MODEL, "--seq", str(CFG.seq), "--stages", str(P), "--microbatches", str(M),
                   "--batch", str(BATCH), "--iterations", str(a.iterations), "--redundancy", "off",
                   "--backward-split", split], env=ENV, cwd=ROOT)
    seconds = statistics.mean(r["seconds"] for r in records[a.warm:-1])
    return seconds, {int(n): mb for n, mb in records[-1]["summary"]["peak_memory_mb"].items()}


def main() -> None:
    """Alternate the two settings over the rounds, then print both and their ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=14)
    ap.add_argument("--warm", type=int, default=5, help="iterations dropped from each run's mean")
    a = ap.parse_args()
    at_least(ap, (("--rounds", a.rounds, 1), ("--warm", a.warm, 0), ("--iterations", a.iterations, a.warm + 2)))
    times: dict[str, list[float]] = {s: [] for s in SPLITS}
    peaks: dict[str, list[dict[int, float]]] = {s: [] for s in SPLITS}
    for r in range(a.rounds):
        for split in SPLITS if r % 2 == 0 else SPLITS[::-1]:
            seconds, peak = one_run(split, a)
            times[split].append(seconds)
            peaks[split].append(peak)
    print(f"GPT {MODEL} (dim {CFG.dim}, {CFG.layers} blocks, seq {CFG.seq}), P={P}, D=1, M={M}, batch={BATCH}, "
          f"--redundancy off, {a.iterations} iterations ({a.warm} dropped), {a.rounds} rounds alternating")
    for split in SPLITS:
        sched = compile_schedule(P, M, options=ScheduleOptions(redundancy="off", split=split))
        report = simulate(sched)
        print(f"--backward-split {split:4}: iteration {statistics.median(times[split]) * 1e3:8.1f} ms (median)   "
              + "   ".join(f"node {n} peak {statistics.median(p[n] for p in peaks[split]):7.1f} MB" for n in range(P))
              + f"   simulated: iteration {report.makespan:.2f}, most forward states held "
              + str([report.peak_live[n] for n in range(P)]))
    if a.rounds < 2:
        return  # no interval from one round
    ratio = interval([x / y for x, y in zip(times["last"], times["off"])])
    print("last / off, geometric mean of the rounds' own ratios, 95% interval (Student's t): iteration time "
          "{:.3f} [{:.3f}, {:.3f}]".format(*ratio) + "".join(
              "   node {} peak RSS {:.3f} [{:.3f}, {:.3f}]".format(
                  n, *interval([x[n] / y[n] for x, y in zip(peaks["last"], peaks["off"])])) for n in range(P)))


if __name__ == "__main__":
    main()
