"""Capacity is a decision: what releasing the nodes in no pipeline, keeping a standby
and growing back gives `auto`, against the baselines' surplus rules, on the
repository's traces (docs/simulator.md, "Capacity is a decision: release, standby,
grow back").

It prints three tables and a summary:

  rules    for each trace, depth P and --surplus rule (keep, burst, binomial, fixed):
           auto's mean paid nodes, goodput, value, idle_fraction,
           idle_unjustified_fraction, acquisition waits' share of its paid node-hours
           (its ledger), nodes released, and auto's value over the best of the other
           spot strategies (checkpoint, redo, bamboo, lazy) under the same rule
  acquire  auto under --surplus burst on the EC2 traces at each --acquire-seconds
  fixed    the fixed over-provisioning at its best: auto's value under --surplus
           fixed at each --fixed-standby 0..4, the best count, and burst's value
  summary  per trace and P: auto's goodput under burst over under keep, and whether
           burst's value beats binomial's and fixed's (at 2, and at its best count)

Each run is what `bamboo-sim --trace T --strategy all --model M --stages P --surplus
RULE [--acquire-seconds A] --json` reports, bamboo-sim's defaults otherwise: the
trace's format detected as bamboo-sim detects it and the notice its cloud gives (EC2
120 s; bursty-zones, an events file, none), --acquire-seconds 300, --standby-epsilon
0.01, --fixed-standby 2, the calibrated profile. Every option is printed above the tables.

Parameters:
  --model M       one of the simulator's profiles (default gpt2)
  --stages LIST   pipeline depths, A,B,... or A-B (default 6,12)
  --traces LIST   trace files, comma-separated (default traces/ec2-p3-trace.csv,
                  traces/ec2-g4dn-trace.csv,traces/bursty-zones.csv)
  --acquire LIST  the acquire table's --acquire-seconds, comma-separated (default 60,120,300,600)
  --json FILE     also write the parameters and every row to FILE

    python scripts/sim_surplus.py [--model gpt2] [--stages 6,12] [--traces A,B] [--acquire 60,120] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, replace

from sim.options import NOTICE_SECONDS
from sim.profiles import PROFILES, profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import TraceError, detect, read

from results import check_target, whole_numbers, write_json  # scripts/results.py, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the traces are the repository's
TRACES = tuple(os.path.join(ROOT, "traces", name)
               for name in ("ec2-p3-trace.csv", "ec2-g4dn-trace.csv", "bursty-zones.csv"))
STRATEGIES = ("checkpoint", "redo", "bamboo", "lazy", "auto")
OTHERS = STRATEGIES[:-1]
RULES = ("keep", "burst", "binomial", "fixed")
ACQUIRE = "60,120,300,600"
FIXED_COUNTS = (0, 1, 2, 3, 4)  # the --fixed-standby values searched for the fixed rule's best
VARIED = ("surplus", "acquire_seconds", "notice_seconds")  # set per run; every other option is BASE's
BASE = Options(replica_sync="end")  # the sync at the end, as docs/simulator.md's tables of this script were taken
RULE_COLUMNS = (("trace", "trace"), ("P", "stages"), ("--surplus", "surplus"), ("mean paid nodes", "mean_nodes"),
                ("goodput", "goodput"), ("value", "value"), ("idle_fraction", "idle_fraction"),
                ("idle_unjustified_fraction", "idle_unjustified_fraction"),
                ("acquisition waits (share)", "waits_share"), ("nodes released", "nodes_released"),
                ("auto / best other", lambda r: f"{r['auto_over_best_other']} ({r['best_other']})"))
FIXED_COLUMNS = (("trace", "trace"), ("P", "stages"),
                 *((f"fixed {n}", lambda r, n=n: r["values"][n]) for n in FIXED_COUNTS),
                 ("best count", "best"), ("burst", "burst"),
                 ("burst / fixed at its best", lambda r: round(r["burst"] / r["best_value"], 4)))
ACQUIRE_COLUMNS = (("trace", "trace"), ("P", "stages"), ("--acquire-seconds", "acquire_seconds"),
                   ("goodput", "goodput"), ("value", "value"), ("mean paid nodes", "mean_nodes"),
                   ("idle_unjustified_fraction", "idle_unjustified_fraction"),
                   ("acquisition waits (share)", "waits_share"))


def waits_share(ledger: dict) -> float:
    """Acquisition waits' share of the paid node-hours (the ledger's parts sum to them)."""
    total = sum(ledger.values())
    return round(ledger.get("acquisition waits", 0.0) / total, 3) if total else 0.0


def auto_figures(run: dict) -> dict:
    return {"mean_nodes": run["mean_nodes"], "goodput": run["goodput"], "value": run["value"],
            "idle_fraction": run["idle_fraction"], "idle_unjustified_fraction": run["idle_unjustified_fraction"],
            "waits_share": waits_share(run["ledger"]), "nodes_released": run["nodes_released"]}


def rules_rows(model: str, traces: list[tuple], depths: list[int]) -> list[dict]:
    """Every spot strategy under every rule; auto's figures and its value over the best other's."""
    rows = []
    for name, fmt, events in traces:
        for depth in depths:
            for rule in RULES:
                options = replace(BASE, surplus=rule, notice_seconds=NOTICE_SECONDS[fmt])
                runs = {s: ClusterSimulator(profile(model), depth, s, options).run(events) for s in STRATEGIES}
                best = max(OTHERS, key=lambda s: runs[s]["value"])  # the first of a tie
                ratio = runs["auto"]["value"] / runs[best]["value"] if runs[best]["value"] > 0 else math.nan
                rows.append({"trace": name, "stages": depth, "surplus": rule, **auto_figures(runs["auto"]),
                             "best_other": best, "auto_over_best_other": round(ratio, 3),
                             "others_value": {s: runs[s]["value"] for s in OTHERS}})
    return rows


def acquire_rows(model: str, traces: list[tuple], depths: list[int], waits: list[float]) -> list[dict]:
    """auto under --surplus burst on the EC2 traces at each --acquire-seconds."""
    rows = []
    for name, fmt, events in traces:
        if fmt != "ec2":
            continue
        for depth in depths:
            for seconds in waits:
                options = replace(BASE, surplus="burst", acquire_seconds=seconds, notice_seconds=NOTICE_SECONDS[fmt])
                run = ClusterSimulator(profile(model), depth, "auto", options).run(events)
                shown = int(seconds) if seconds.is_integer() else seconds  # 60, as the flag was given
                rows.append({"trace": name, "stages": depth, "acquire_seconds": shown, **auto_figures(run)})
    return rows


def fixed_rows(model: str, traces: list[tuple], depths: list[int], rules: list[dict]) -> list[dict]:
    """auto under --surplus fixed at each of FIXED_COUNTS: the baseline at its best
    count, beside burst's value (from `rules`)."""
    rows = []
    for name, fmt, events in traces:
        for depth in depths:
            values = {n: ClusterSimulator(profile(model), depth, "auto", replace(
                BASE, surplus="fixed", fixed_standby=n, notice_seconds=NOTICE_SECONDS[fmt])).run(events)["value"]
                for n in FIXED_COUNTS}
            best = max(values, key=values.get)  # the smallest count of a tie
            burst = next(r["value"] for r in rules if (r["trace"], r["stages"], r["surplus"]) == (name, depth, "burst"))
            rows.append({"trace": name, "stages": depth, "values": values, "best": best, "best_value": values[best],
                         "burst": burst})
    return rows


def table(columns: tuple, rows: list[dict]) -> str:
    """A markdown table; a column's key is a row's field or a function of the row."""
    def cell(row: dict, key) -> str:
        return str(key(row) if callable(key) else row[key])
    lines = ["| " + " | ".join(head for head, _ in columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return "\n".join([*lines, *("| " + " | ".join(cell(r, key) for _, key in columns) + " |" for r in rows)])


def summary(rows: list[dict], fixed: list[dict]) -> list[str]:
    """Per trace and P: goodput under burst over keep; burst's value against
    binomial's, fixed's and fixed's at its best count."""
    lines = []
    best = {(r["trace"], r["stages"]): r for r in fixed}
    for trace, depth in dict.fromkeys((r["trace"], r["stages"]) for r in rows):
        by = {r["surplus"]: r for r in rows if (r["trace"], r["stages"]) == (trace, depth)}
        keep, burst = by["keep"]["goodput"], by["burst"]["goodput"]
        gain = f"×{burst / keep:.3f}" if keep > 0 else "n/a (keep's goodput is 0)"
        against = "; ".join(f"{'beats' if by['burst']['value'] > by[rule]['value'] else 'does not beat'} {rule} "
                            f"({by['burst']['value']} against {by[rule]['value']})" for rule in ("binomial", "fixed"))
        top = best[(trace, depth)]
        against += (f"; {'beats' if top['burst'] > top['best_value'] else 'does not beat'} fixed at its best "
                    f"count, {top['best']} ({top['burst']} against {top['best_value']})")
        lines.append(f"- {trace} P={depth}: auto's goodput, burst over keep {gain}; burst's value {against}")
    return lines


def parse_traces(ap: argparse.ArgumentParser, text: str) -> list[tuple]:
    """(name, format, events) of each path, read as bamboo-sim reads it (--trace-format auto)."""
    paths = [p.strip() for p in text.split(",")]
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if not all(paths) or len(set(names)) != len(names):
        ap.error(f"--traces {text!r}: expected trace files A,B,..., no name twice")
    traces = []
    for path, name in zip(paths, names):
        if not os.path.isfile(path):
            ap.error(f"--traces: {path!r} is not a file")
        try:
            fmt = detect(path)
            traces.append((name, fmt, read(path, fmt)))
        except (TraceError, OSError, UnicodeDecodeError) as e:
            ap.error(f"--traces: {e}")
    return traces


def parse_seconds(ap: argparse.ArgumentParser, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= v < math.inf for v in values):
        ap.error(f"--acquire {text!r}: expected seconds A,B,..., each finite and not negative")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--stages", default="6,12")
    ap.add_argument("--traces", default=",".join(os.path.relpath(p) for p in TRACES))
    ap.add_argument("--acquire", default=ACQUIRE, help="--acquire-seconds of the acquire table, A,B,...")
    ap.add_argument("--json", help="also write the parameters and every row to FILE")
    args = ap.parse_args()
    if args.model not in PROFILES:
        ap.error(f"--model {args.model!r}: unknown (known: {', '.join(sorted(PROFILES))})")
    depths = whole_numbers(ap, "--stages", args.stages, 2)
    if max(depths) > profile(args.model).layers:
        ap.error(f"--stages {args.stages!r}: model {args.model} has {profile(args.model).layers} layers")
    waits = parse_seconds(ap, args.acquire)
    check_target(ap, "--json", args.json)
    traces = parse_traces(ap, args.traces)
    parameters = {"model": args.model, "profile": profile(args.model).sources()["source"], "stages": depths,
                  "strategies": STRATEGIES, "rules": RULES, "acquire_seconds": waits,
                  "traces": {name: {"format": fmt, "notice_seconds": NOTICE_SECONDS[fmt]} for name, fmt, _ in traces},
                  "options": {k: v for k, v in asdict(BASE).items() if k not in VARIED}}
    rules, acquire = rules_rows(args.model, traces, depths), acquire_rows(args.model, traces, depths, waits)
    fixed = fixed_rows(args.model, traces, depths, rules)
    print(f"model {args.model}, profile {parameters['profile']}; traces (format, notice seconds): "
          + ", ".join(f"{n} ({t['format']}, {t['notice_seconds']:g})" for n, t in parameters["traces"].items()))
    print(f"rules: --acquire-seconds {Options.acquire_seconds:g}, every spot strategy under each --surplus; "
          f"acquire: auto, --surplus burst; every other option: {json.dumps(parameters['options'])}")
    print()
    print(table(RULE_COLUMNS, rules))
    print()
    print(table(ACQUIRE_COLUMNS, acquire))
    print()
    print(table(FIXED_COLUMNS, fixed))
    print()
    print("\n".join(summary(rules, fixed)))
    if args.json:
        write_json(args.json, {"parameters": parameters, "rules": rules, "acquire": acquire, "fixed": fixed})


if __name__ == "__main__":
    main()
