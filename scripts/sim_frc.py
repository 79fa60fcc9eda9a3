"""What eager FRC costs a fault-free iteration on the calibrated profiles.

For each model and depth P, with D pipelines sharing the profile's 24 global
microbatches, the schedule simulator's iteration without redundancy (off), with
the replicas kept in sync but no FRC (lazy), with FRC in the bubbles only
(--frc bubbles) and for every microbatch (--frc all); the share of microbatches
the bubbles hold FRC for (mean over the nodes); and bubbles / off again with the
replica sync's transfer costed 0 (what is left once the sync is off the critical
path). Then the same bounded eager with the sync in the next iteration
(`--replica-sync next`, schedules/syncs.py: compiled and simulated; bamboo-train
runs it too): its iteration over off's, the share of microbatches its bubbles
hold FRC for, and its window: the mean over owners of when their sync has landed,
over the iteration (a death of an owner before that is not survivable within the
iteration). Every number of the cost model is the profile's (`Profile.cost`).

    python scripts/sim_frc.py [--models gpt2,bert-large] [--stages 4-12] [--pipelines 1,2] [--json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics

from schedules.compiler import compile_schedule, simulate
from sim.profiles import PROFILES, profile

from results import check_target, whole_numbers, write_json  # scripts/results.py, beside this file
from schedules.options import ScheduleOptions


def row(model: str, depth: int, pipelines: int) -> dict:
    prof = profile(model, "calibrated")
    microbatches = math.ceil(prof.microbatches / pipelines)
    cost = prof.cost(depth, pipelines)

    def makespan(mode: str, frc: str = "bubbles", c=cost) -> float:
        return simulate(compile_schedule(depth, microbatches, (), ScheduleOptions(redundancy=mode, frc=frc), c)).makespan

    bounded = compile_schedule(depth, microbatches, (), ScheduleOptions(redundancy="eager"), cost)
    hidden = dataclasses.replace(cost, sync_transfer=0.0)
    off, lazy, bubbles, every = makespan("off"), makespan("lazy"), makespan("eager"), makespan("eager", "all")
    late = compile_schedule(depth, microbatches, (), ScheduleOptions(redundancy="eager", sync="next"), cost)
    report = simulate(late)
    landed = [s.end + cost.sync_transfer for s in report.spans if s.instr.op.value == "send_sync"]
    return {"model": model, "stages": depth, "pipelines": pipelines, "microbatches": microbatches,
            "off_ms": round(off, 1), "lazy_ms": round(lazy, 1), "bubbles_ms": round(bubbles, 1),
            "all_ms": round(every, 1), "bubbles_over_off": bubbles / off, "bubbles_over_lazy": bubbles / lazy,
            "all_over_off": every / off,
            "frc_held": statistics.mean(len(bounded.frc_microbatches(n)) / microbatches for n in bounded.streams),
            "bubbles_over_off_sync_hidden": makespan("eager", c=hidden) / makespan("off", c=hidden),
            "next_ms": round(report.makespan, 1), "next_over_off": report.makespan / off,
            "next_frc_held": statistics.mean(len(late.frc_microbatches(n)) / microbatches for n in late.streams),
            "next_window": statistics.mean(landed) / report.makespan,
            "cost": {k: v for k, v in dataclasses.asdict(cost).items() if not k.startswith("_")}}


def table(rows: list[dict]) -> str:
    lines = ["| model | P | D | M | off (ms) | bubbles / off | bubbles / lazy | all / off | FRC held | "
             "bubbles / off, sync hidden | sync next / off | FRC held, next | window, next |", "| --- " * 13 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['stages']} | {r['pipelines']} | {r['microbatches']} | {r['off_ms']} | "
                     f"{r['bubbles_over_off']:.3f} | {r['bubbles_over_lazy']:.4f} | {r['all_over_off']:.3f} | "
                     f"{r['frc_held']:.2f} | {r['bubbles_over_off_sync_hidden']:.3f} | {r['next_over_off']:.3f} | "
                     f"{r['next_frc_held']:.2f} | {r['next_window']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,bert-large")
    ap.add_argument("--stages", default="4-12", help="a range A-B or a list")
    ap.add_argument("--pipelines", default="1,2")
    ap.add_argument("--json", help="also write every row, with its cost model, to FILE")
    args = ap.parse_args()
    depths = whole_numbers(ap, "--stages", args.stages, 2)
    widths = whole_numbers(ap, "--pipelines", args.pipelines, 1)
    if unknown := [m for m in args.models.split(",") if m not in PROFILES]:
        ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(sorted(PROFILES))})")
    check_target(ap, "--json", args.json)
    rows = [row(m, p, d) for m in args.models.split(",") for p in depths for d in widths]
    for model in args.models.split(","):
        print(f"{model}: {json.dumps(profile(model, 'calibrated').sources())}")
    print(table(rows))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
