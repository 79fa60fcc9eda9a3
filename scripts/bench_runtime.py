"""Runtime benchmark: what eager and lazy redundancy cost on real processes, and
how long a preemption pauses training in each.

Runs bamboo-train with P=2, D=1 (one process per core on a 2-core machine, the
only layout where a bubble is really idle), alternating --redundancy off, eager
(FRC in the bubbles only, the default), eager with --frc all (FRC for every
microbatch, the placement before FRC was bounded to the bubbles) and lazy, eager and lazy again with
each replica's sync in the next iteration (--replica-sync next), and prints side-by-side
ratios: mean iteration time (warm-up iterations dropped) and peak process
memory; and in every round, per redundant mode, one run with a node SIGKILLed
mid-iteration, whose pause (kill to the end of that iteration) is printed as the
median over the rounds, every round's beside it.

    python scripts/bench_runtime.py [--rounds 3] [--iterations 30] [--batch 8] [--modes off,eager,...]

The ratios to off are also given as the geometric mean of each round's own ratio
with its 95% interval (the modes alternate within a round, so a round's ratio is
the least touched by the machine's load drifting between rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

from results import at_least, interval  # scripts/results.py, beside this file


def run(args: list[str], **popen) -> list[dict]:
    """The metrics records of one bamboo-train run (`popen`: env, cwd)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--metrics-out", f.name, *args],
                       check=True, stdout=subprocess.DEVNULL, **popen)
        return [json.loads(line) for line in open(f.name)]


MODES = {"off": ["--redundancy", "off"], "eager": ["--redundancy", "eager"],
         "eager-all": ["--redundancy", "eager", "--frc", "all"], "lazy": ["--redundancy", "lazy"],
         "eager-next": ["--redundancy", "eager", "--replica-sync", "next"],
         "lazy-next": ["--redundancy", "lazy", "--replica-sync", "next"]}
REDUNDANT = list(MODES)[1:]  # off cannot survive a death without agents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"off and any of {', '.join(REDUNDANT)}")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if "off" not in modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        ap.error(f"--modes {a.modes!r}: expected off and any of {', '.join(REDUNDANT)}, each once")
    # 12 iterations: the kill at the middle one comes after the 5 warm-up iterations
    at_least(ap, (("--rounds", a.rounds, 1), ("--iterations", a.iterations, 12), ("--batch", a.batch, 1),
                  ("--microbatches", a.microbatches, 1)))
    common = ["--model", "tiny", "--stages", "2", "--microbatches", str(a.microbatches),
              "--iterations", str(a.iterations), "--batch", str(a.batch)]
    warm = 5  # eager places FRC by measured op times from iteration 4 (bamboo/runtime/calibration.py)
    kill_at = a.iterations // 2
    # node 0 just before its second activation leaves, mid-run: its successor's stage
    # is then recovered from what eager's FRC (if the measured model placed any) and
    # lazy's kept inputs give
    kill = ["--preempt", f"0@{kill_at}:5"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    memory: dict[str, list[float]] = {m: [] for m in modes}
    pauses: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
    for round_ in range(a.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:  # no mode always right after the kills
            records = run(common + MODES[mode])
            times[mode].append(statistics.mean(r["seconds"] for r in records[warm:-1]))
            memory[mode].append(max(records[-1]["summary"]["peak_memory_mb"].values()))
        for mode in pauses:
            records = run(common + MODES[mode] + kill)
            pauses[mode].append(next(e["pause_seconds"] for r in records[:-1] for e in r["events"]
                                     if e["type"] == "preemption"))
    report(a, times, memory, pauses, kill)


def report(a, times: dict, memory: dict, pauses: dict, kill: list[str]) -> None:
    """The medians, each mode's ratios to off (paired over rounds too) and the pauses."""
    modes, redundant = list(times), list(pauses)
    t = {m: statistics.median(times[m]) for m in modes}
    mem = {m: statistics.median(memory[m]) for m in modes}
    print(f"P=2 D=1 M={a.microbatches} batch={a.batch} tiny, {a.rounds} rounds alternating, median of means")
    print("iteration time  " + "   ".join(f"{m} {t[m] * 1e3:8.1f} ms" for m in modes)
          + "   " + "   ".join(f"{m}/off {t[m] / t['off']:.3f}" for m in redundant))
    if a.rounds >= 2 and redundant:
        print("geometric mean of the rounds' own ratios, 95% interval over rounds (Student's t): " + "   ".join(
            "{}/off {:.3f} [{:.3f}, {:.3f}]".format(m, *interval([x / o for x, o in zip(times[m], times["off"])]))
            for m in redundant))
    print("peak RSS        " + "   ".join(f"{m} {mem[m]:8.1f} MB" for m in modes)
          + "   " + "   ".join(f"{m}/off {mem[m] / mem['off']:.3f}" for m in redundant))
    if not pauses:
        return
    pause = {m: statistics.median(v) for m, v in pauses.items()}
    print(f"pause after a SIGKILL ({' '.join(kill)}), median of {a.rounds}: "
          + "   ".join(f"{m} {pause[m] * 1e3:.1f} ms ({pause[m] / t[m]:.2f} iterations)" for m in pause)
          + (f"   eager/lazy {pause['eager'] / pause['lazy']:.3f}" if {"eager", "lazy"} <= set(pause) else ""))
    for m, v in pauses.items():
        print(f"  {m:9} pauses (ms): " + " ".join(f"{x * 1e3:.1f}" for x in v))


if __name__ == "__main__":
    main()
