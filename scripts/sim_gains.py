"""What each step toward every paid node training (shorter pipelines, notices,
rollbacks from memory) gains every strategy, on the repository's traces.

For each trace and depth, every spot strategy is simulated four times, adding one
thing at a time, so that the gain is not only ours to claim:

  whole     whole pipelines only, preemptions unannounced, a rollback relaunches
  +short    pipelines shorter than P (--max-stages-per-node 2) where faster
  +memory   a stage lost everywhere comes back from a checkpoint copy in a peer's memory
  +notice   the trace's cloud notice (EC2 120 s): drain ahead, or checkpoint on notice
  +release  the nodes in no pipeline released but for the burst rule's standby, asked
            for again --acquire-seconds away (--surplus burst; the steps before keep every node)

It prints goodput (samples/s per paid node, relative to an on-demand node's),
idle_fraction, value (samples/s per $/h) and the bound a scheduler that loses
nothing could reach with the same pipelines, with every parameter behind them.

    python scripts/sim_gains.py [--model gpt2] [--stages 6,12] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from sim.options import NOTICE_SECONDS
from sim.profiles import PROFILES, profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import read

from results import check_target, whole_numbers, write_json  # scripts/results.py, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the traces are the repository's
TRACES = tuple(os.path.join(ROOT, "traces", name) for name in ("ec2-p3-trace.csv", "ec2-g4dn-trace.csv"))
STRATEGIES = ("checkpoint", "redo", "bamboo", "lazy", "auto")
SYNC = dict(replica_sync="end")  # the sync at the end, as docs/simulator.md's table of this script was taken
STEPS = {"whole": dict(max_stages=1, notice_seconds=0.0, rollback="relaunch", surplus="keep"),
         "+short": dict(max_stages=2, notice_seconds=0.0, rollback="relaunch", surplus="keep"),
         "+memory": dict(max_stages=2, notice_seconds=0.0, rollback="memory", surplus="keep"),
         "+notice": dict(max_stages=2, notice_seconds=NOTICE_SECONDS["ec2"], rollback="memory", surplus="keep"),
         "+release": dict(max_stages=2, notice_seconds=NOTICE_SECONDS["ec2"], rollback="memory", surplus="burst")}


def run(model: str, depths: list[int]) -> list[dict]:
    rows = []
    for path in TRACES:
        events = read(path, "ec2")
        for depth in depths:
            for strategy in STRATEGIES:
                for step, settings in STEPS.items():
                    r = ClusterSimulator(profile(model), depth, strategy, Options(**settings, **SYNC)).run(events)
                    rows.append({"trace": os.path.basename(path), "stages": depth, "strategy": strategy,
                                 "step": step, **{k: r[k] for k in ("goodput", "goodput_bound", "idle_fraction",
                                                                    "value", "fatal_failures")}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| trace | P | strategy | " + " | ".join(STEPS) + " | bound (kept) | idle (kept) |",
             "| --- | --- | --- | " + " | ".join("---" for _ in STEPS) + " | --- | --- |"]
    keys = sorted({(r["trace"], r["stages"], r["strategy"]) for r in rows},
                  key=lambda k: (k[0], k[1], STRATEGIES.index(k[2])))
    for trace, depth, strategy in keys:
        mine = {r["step"]: r for r in rows if (r["trace"], r["stages"], r["strategy"]) == (trace, depth, strategy)}
        last = mine["+notice"]
        lines.append(f"| {trace} | {depth} | {strategy} | " + " | ".join(f"{mine[s]['goodput']:.3f}" for s in STEPS)
                     + f" | {last['goodput_bound']:.3f} | {last['idle_fraction']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--stages", default="6,12")
    ap.add_argument("--json", help="also write every row to FILE")
    args = ap.parse_args()
    depths = whole_numbers(ap, "--stages", args.stages, 2)
    if args.model not in PROFILES:
        ap.error(f"--model {args.model!r}: unknown (known: {', '.join(sorted(PROFILES))})")
    check_target(ap, "--json", args.json)
    rows = run(args.model, depths)
    print(f"model {args.model}, profile calibrated; goodput per step (docstring); every other option: "
          f"{json.dumps({k: v for k, v in asdict(Options(**SYNC)).items() if k not in STEPS['whole']})}")
    print(table(rows))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
