"""`bamboo-sim`: samples per second per dollar of a training job over a preemption
trace, for Bamboo's redundant computation, redo from data-parallel peers,
checkpoint-restart and on-demand nodes.

    bamboo-sim --trace PATH [--trace-format ec2|gcp|events|zone-counts|auto] \\
               --strategy bamboo|lazy|redo|checkpoint|on-demand|auto|all [--redundancy eager|lazy|off|auto] \\
               --model gpt2|bert-large|BAMBOO_TRAIN_MODEL [--profile calibrated|arithmetic] --stages P \\
               [--hours H] [--json] [--plot DIR] [--frc bubbles|all] [--replica-sync end|next] \\
               [--model-config FILE.json] [--seq N] [--batch N] [--precision fp32|bf16|fp16] \\
               [--instance-type TYPE [--prices FILE.json]] [--cross-zone-price $/GiB] [--etcd-price $/h] \\
               [--storage-price $/GiB-month] [--boot-seconds S] [--acquire-seconds S] [--standby-epsilon E] \\
               [--surplus burst|binomial|fixed|keep] [--fixed-standby N] [--price-series FILE] \\
               [--zone-spread auto|spread|pack] [--jobs N|auto]
    bamboo-sim --sweep-rates --model gpt2 --stages P [--plot DIR]

Checkpoints are taken at Young's or Daly's optimal interval unless --checkpoint-minutes
fixes one; every cost parameter below appears in the JSON output.
Bad input ends with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from schedules.redundancy import FRC_MODES
from schedules.options import JobReplicaSync

from commands.train.flag_checks import changed_flags, check_finite, check_not_a_file, said_idle
from bamboo.control.parser import OneLineParser

from agents.surplus import SurplusRule
from sim import model_spec
from sim.checkpointing import FORMULAS
from sim.interval_search import BEST, best_run
from sim.job_model import JobModel
from sim.pricing import cross_zone_bytes, crossing_shares, first_config, ledger_dollars, priced, replica_share, sent
from sim.options import NOTICE_SECONDS, ROLLBACKS, ZONE_SPREADS
from sim.price_series import series_from
from sim.plots import plot_run, plot_sweep
from sim.profiles import PROFILES, SOURCES, Profile
from sim.runs import jobs_of, run_each
from sim.simulator import STRATEGIES, ClusterSimulator, Options
from sim.traces import TraceError, detect, read, synthetic

SWEEP_RATES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # preemptions per node-hour
# --strategy bamboo --redundancy MODE: the strategy that runs Bamboo in that mode
REDUNDANCY = {"eager": "bamboo", "lazy": "lazy", "off": "redo", "auto": "auto"}
GB = 1e9


class _Parser(OneLineParser):
    def error(self, message: str) -> None:
        print(f"bamboo-sim: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bamboo-sim", description=__doc__.splitlines()[0])
    p.add_argument("--trace", help="trace file")
    p.add_argument("--trace-format", choices=("ec2", "gcp", "events", "zone-counts", "auto"), default="auto",
                   help="the trace's format (auto: from its first lines)")
    p.add_argument("--strategy", choices=(*STRATEGIES, "all"), default="bamboo",
                   help="how the job survives preemptions (all: each, side by side; docs/simulator.md)")
    p.add_argument("--redundancy", choices=tuple(REDUNDANCY),
                   help="with --strategy bamboo: eager (default), lazy, off (redo from peers) or auto")
    p.add_argument("--model", default="gpt2",
                   help=f"one of the simulator's profiles ({', '.join(sorted(PROFILES))}: sim/profiles.py; gpt2 is "
                        "GPT-2's 1.5B shape, not bamboo-train's hf:gpt2), or any bamboo-train --model (hf:llama-1b, "
                        "...), its layers counted and its network bytes planned")
    p.add_argument("--profile", choices=SOURCES, default="calibrated",
                   help="per-op times measured on this machine and scaled, or transformer arithmetic")
    p.add_argument("--stages", type=int, default=12, help="pipeline depth P")
    p.add_argument("--microbatches", type=int,
                   help="global microbatches per iteration (default: the model profile's, 24)")
    p.add_argument("--hours", type=float, help="simulate only the first H hours of the trace")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    p.add_argument("--sweep-rates", action="store_true",
                   help="synthetic traces over a range of preemption rates: value per strategy")
    p.add_argument("--nodes", type=int, help="cluster size of the synthetic traces (default 3 x P)")
    p.add_argument("--seeds", type=int, default=3, help="synthetic traces per rate")
    p.add_argument("--plot", metavar="DIR", help="write PNGs: nodes and throughput over time, value vs rate")
    p.add_argument("--jobs", default="auto", metavar="N|auto",
                   help="strategies run at a time, each in a process of its own (the figures are the same); "
                        "auto: one per CPU this process may run on")
    _cost_arguments(p)
    model_spec.add_flags(p)
    return p


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    d = Options()
    p.add_argument("--spot-price", type=float, default=d.spot_price, help="USD per node-hour")
    p.add_argument("--on-demand-price", type=float, default=d.on_demand_price, help="USD per node-hour")
    p.add_argument("--checkpoint-minutes", type=float, help="a fixed checkpoint interval (default: the formula's)")
    p.add_argument("--checkpoint-formula", choices=(*FORMULAS, BEST), default=d.checkpoint_formula,
                   help="the checkpoint interval: Young's or Daly's from the observed preemption rate, or the best "
                        "of those and fixed ones from 1 minute to never, searched on this trace (best)")
    p.add_argument("--bytes-per-param", type=float, default=d.checkpoint_bytes_per_param,
                   help="checkpointed bytes per parameter (fp32 weights + AdamW moments: 12)")
    p.add_argument("--storage-bandwidth", type=float, default=d.storage_bandwidth / GB,
                   help="GB/s per node to and from checkpoint storage")
    p.add_argument("--snapshot-bandwidth", type=float, default=d.snapshot_bandwidth / GB,
                   help="GB/s accelerator to host (the snapshot stall)")
    p.add_argument("--peer-bandwidth", type=float, default=d.peer_bandwidth / GB,
                   help="GB/s of a stage reloaded from a peer pipeline")
    p.add_argument("--free-checkpoints", action="store_true", help="writes cost nothing (the old baseline)")
    p.add_argument("--relaunch-seconds", type=float, default=d.relaunch_seconds,
                   help="a restart's time to start the job's processes again")
    p.add_argument("--warmup-seconds", type=float, default=d.warmup_seconds,
                   help="a new node's time before it can take part (boot, install, join)")
    p.add_argument("--restart-seconds", type=float, help="a fixed restart cost instead of relaunch + load + warm-up")
    p.add_argument("--max-stages-per-node", type=int, default=d.max_stages,
                   help="stages one node may hold (2: spare nodes may form pipelines shorter than P; "
                        "1: whole pipelines only)")
    p.add_argument("--notice-seconds", type=float,
                   help="preemptions are announced this long ahead (default by trace format: ec2 120, gcp 30, "
                        "events and --sweep-rates 0)")
    p.add_argument("--frc", choices=FRC_MODES, default=d.frc,
                   help="eager: FRC only where the schedule's cost model says it fits the bubbles, the rest "
                        "recomputed after a death (bubbles); or for every microbatch, in a longer iteration (all)")
    p.add_argument("--replica-sync", choices=JobReplicaSync.values(), default=d.replica_sync,
                   help="eager and lazy: each replica's sync at the iteration's end (end), or in the next iteration, "
                        "off the critical path, a death before it landed charged a redo from peers or, with one "
                        "pipeline, a rollback (next; bamboo-train runs it alike); or chosen at every "
                        "reconfiguration from the costs and the deaths seen, as auto chooses its mode (auto)")
    p.add_argument("--acquire-seconds", type=float, default=d.acquire_seconds,
                   help="a node's wait, request to join: how long a node asked for from the trace's free ones "
                        "takes, and the window the burst rule sizes the standby for")
    p.add_argument("--standby-epsilon", type=float, default=d.standby_epsilon,
                   help="the burst rule: the standby covers losses within --acquire-seconds but with this chance")
    p.add_argument("--surplus", choices=SurplusRule.values(), default=d.surplus,
                   help="the nodes beyond the pipelines: a standby sized by the observed bursts, each kept while it "
                        "earns its price, the rest released (burst); ByteRobust's binomial quantile (binomial); "
                        "--fixed-standby nodes (fixed); or every node the trace grants, never released (keep)")
    p.add_argument("--fixed-standby", type=int, default=d.fixed_standby,
                   help="--surplus fixed: the standby nodes kept")
    p.add_argument("--price-series", metavar="FILE",
                   help='the spot price over time instead of --spot-price: JSON {"metadata": {"gap_seconds": G}, '
                        '"data": [USD per node-hour, ...]}, each node-second paid at the price of its time')
    p.add_argument("--zone-spread", choices=ZONE_SPREADS, default=d.zone_spread,
                   help="neighbouring stages in different zones (spread), each pipeline packed in as few zones as it "
                        "can (pack), or whichever costs less: the bytes between zones at --cross-zone-price against "
                        "the bursts spreading survives (auto; with no price, spread)")
    p.add_argument("--rollback", choices=ROLLBACKS, default=d.rollback,
                   help="a stage lost everywhere: survivors stay up and load checkpoint copies held in peers' "
                        "memory (memory), or every process relaunches (relaunch)")


def options_from(args, kind=None) -> Options:
    """The run's options; `kind` (--instance-type's row) sets the prices."""
    if kind is not None:
        if args.price_series:
            raise ValueError("--instance-type sets the prices: leave out --price-series (or --instance-type)")
        if args.spot_price != Options.spot_price or args.on_demand_price != Options.on_demand_price:
            raise ValueError("--instance-type sets the prices: leave out --spot-price and --on-demand-price "
                             "(--prices FILE changes the table's)")
        args.spot_price, args.on_demand_price = kind.spot, kind.on_demand
    for name in ("checkpoint_minutes", "storage_bandwidth", "snapshot_bandwidth", "peer_bandwidth"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive (got {value})")
    options = Options(
        spot_price=args.spot_price, on_demand_price=args.on_demand_price,
        checkpoint_seconds=args.checkpoint_minutes * 60 if args.checkpoint_minutes else None,
        checkpoint_formula="daly" if args.checkpoint_formula == BEST else args.checkpoint_formula,
        checkpoint_bytes_per_param=args.bytes_per_param,
        storage_bandwidth=args.storage_bandwidth * GB, snapshot_bandwidth=args.snapshot_bandwidth * GB,
        peer_bandwidth=args.peer_bandwidth * GB, free_checkpoints=args.free_checkpoints,
        relaunch_seconds=args.relaunch_seconds, warmup_seconds=args.warmup_seconds,
        restart_seconds=args.restart_seconds, max_stages=args.max_stages_per_node,
        notice_seconds=args.notice_seconds or 0.0, rollback=args.rollback, frc=args.frc,
        acquire_seconds=args.acquire_seconds, standby_epsilon=args.standby_epsilon,
        surplus=args.surplus, fixed_standby=args.fixed_standby, replica_sync=args.replica_sync,
        price_series=series_from(args.price_series, args.spot_price != Options.spot_price),
        zone_spread=args.zone_spread, cross_zone_price=args.cross_zone_price)
    try:
        options.check()
    except ValueError as e:
        raise ValueError(str(e).replace("--checkpoint-bytes-per-param", "--bytes-per-param")) from None
    return options


def model_of(args, nodes: int) -> JobModel:
    """The simulated job on `nodes` nodes: a bamboo-train model as its plan counts it,
    or one of the simulator's profiles with transformer arithmetic for its bytes."""
    if model_spec.is_training_model(args):
        return model_spec.training_model(args, nodes)
    prof = model_profile(args)
    links = prof.links(args.stages, max(1, nodes // args.stages), replicas=True)
    return JobModel(prof, links, args.bytes_per_param * prof.layer_params * prof.layers, prof.seq)


def model_profile(args) -> Profile:
    """The simulator's own profile, with --microbatches when given (checked by
    model_spec.check_shape)."""
    base = model_spec.own_profile(args)
    return base if args.microbatches is None else replace(base, microbatches=args.microbatches)


def sweep(prof: Profile, stages: int, nodes: int, seeds: int, options: Options,
          hours: float = 12.0) -> list[dict]:
    """Value per strategy, averaged over `seeds` synthetic traces per rate."""
    rows = []
    for rate in SWEEP_RATES:
        row = {"rate": rate}
        traces = [synthetic(hours, nodes, options.zones, rate, seed, bulk=0.1) for seed in range(seeds)]
        for strategy in STRATEGIES:
            sim = ClusterSimulator(prof, stages, strategy, options)
            runs = [sim.run(trace, hours) for trace in traces]
            row[strategy] = round(sum(r["value"] for r in runs) / seeds, 5)
            row[f"{strategy}_fatal"] = sum(r["fatal_failures"] for r in runs) / seeds
        rows.append(row)
    return rows


def _plotted(results: dict, directory: str | None) -> None:
    """The runs' plots, when asked for, named in each run; then their timelines
    dropped (the JSON keeps figures, not every event)."""
    if directory:
        plots = plot_run(results, directory)
        for r in results.values():
            r["plots"] = plots
    for r in results.values():
        r.pop("timeline")


def simulate(args, options: Options, jobs: int) -> dict:
    """One trace: one strategy's summary, or with `all` every strategy's under
    "strategies", each priced (sim/pricing.py) under "priced"."""
    if not args.trace:
        raise ValueError("--trace PATH is required (or --sweep-rates)")
    if args.hours is not None and args.hours <= 0:
        raise ValueError("--hours must be positive")
    events = read(args.trace, args.trace_format)
    if args.notice_seconds is None:  # what the trace's cloud announces
        fmt = detect(args.trace) if args.trace_format == "auto" else args.trace_format
        options = replace(options, notice_seconds=NOTICE_SECONDS[fmt])
    options = replace(options, startup_seconds=max(options.startup_seconds, args.boot_seconds))  # paid, not working
    first = first_nodes(events, options.zones)
    job = model_of(args, len(first))
    check_depth(job.profile, args.stages)
    bill = model_spec.charges(args, job.checkpoint_bytes)
    options = replace(options, zone_bytes=tuple(job.links.items()))  # what --zone-spread auto prices
    name = strategy_name(args)
    results, stats = {}, {}
    names = list(STRATEGIES) if name == "all" else [name]
    for strategy, ((run, seen), seconds) in run_each(runner(job, args, events, options), names, jobs).items():
        results[strategy], run["run_seconds"] = run, seconds
        stats.update(seen)
        on_demand = strategy == "on-demand"  # in one zone, its best placement: nothing crosses
        links = sent(job.links, replica_share(strategy, [run]))
        shares = crossing_shares(first_config(first, args.stages, job.profile.microbatches, options, links), first)
        cross = 0.0 if on_demand else cross_zone_bytes(links, shares)
        arrivals = round(run["mean_nodes"]) if on_demand else sum(e.action == "add" and e.time <= run["hours"] * 3600
                                                                   for e in events)
        price = options.on_demand_price if on_demand else run.get("mean_spot_price", options.spot_price)
        run["priced"] = priced(run, arrivals, price, job.tokens_per_sample, job.profile.samples_per_iteration(), cross,
                               bill)
        run["ledger_dollars"] = ledger_dollars(run["ledger"], price, run["priced"])
    _plotted(results, args.plot)
    context = {"trace": {"path": args.trace, **stats}, "model": args.model, "stages": args.stages,
               "prices": {"spot": options.price_series.describe() if options.price_series else options.spot_price,
                          "on_demand": options.on_demand_price},
               "charges": bill.describe(), "job": job.describe(),
               "notice_seconds": options.notice_seconds, "max_stages_per_node": options.max_stages,
               "rollback": options.rollback, "frc": options.frc, "replica_sync": options.replica_sync,
               "microbatches": job.profile.microbatches, "profile": job.profile.sources()}
    if name == "all":
        return {**context, "strategies": results}
    return {**results[name], **context}


def runner(job: JobModel, args, events: list, options: Options):
    """One strategy's run over `events` (at the best interval, where searched) and
    the trace's figures: what `run_each` runs, here or in a process of its own."""
    def each(strategy: str) -> tuple[dict, dict]:
        seen: dict = {}

        def one(opts: Options) -> dict:
            sim = ClusterSimulator(job.profile, args.stages, strategy, opts)
            out = sim.run(events, args.hours)
            seen.update(sim.trace.describe())
            return out
        searched = args.checkpoint_formula == BEST and strategy != "on-demand"  # on-demand takes no checkpoint
        return best_run(one, options) if searched else one(options), seen
    return each


def first_nodes(events, zones: tuple[str, ...]) -> dict[str, str]:
    """node -> zone of the trace's first nodes (those its first moment adds), zones
    dealt in turn where the trace has none."""
    start = events[0].time if events else 0.0
    found = [e for e in events if e.time == start and e.action == "add"]
    return {e.node: e.zone or zones[i % len(zones)] for i, e in enumerate(found)}


def strategy_name(args) -> str:
    """The simulator's strategy for --strategy and --redundancy (only bamboo has modes)."""
    if args.redundancy is None:
        return args.strategy
    if args.strategy != "bamboo":
        raise ValueError(f"--redundancy goes with --strategy bamboo only (got --strategy {args.strategy})")
    return REDUNDANCY[args.redundancy]


def idle_notes(parser: argparse.ArgumentParser, args) -> list[str]:
    """One line per reason, naming the flags set away from their defaults that this
    run does not read."""
    eager_free = not args.sweep_rates and strategy_name(args) not in ("bamboo", "auto", "all")
    replica_free = not args.sweep_rates and strategy_name(args) not in ("bamboo", "lazy", "auto", "all")
    rules = ((not args.sweep_rates, ("nodes", "seeds"), "they are for --sweep-rates"),
             (args.sweep_rates, ("trace", "trace_format", "hours", "strategy", "jobs"),
              "--sweep-rates runs every strategy on synthetic traces of its own"),
             (not args.sweep_rates and strategy_name(args) != "all", ("jobs",), "one strategy runs in one process"),
             (args.sweep_rates, ("cross_zone_price", "etcd_price", "storage_price", "boot_seconds", "price_series"),
              "--sweep-rates reports value per node-hour's price only"),
             (eager_free, ("frc",), "it places eager Bamboo's FRC (--strategy bamboo, auto or all)"),
             (args.surplus != SurplusRule.FIXED, ("fixed_standby",), "it is the standby of --surplus fixed"),
             (replica_free, ("replica_sync",), "only Bamboo's replicas are synced (--strategy bamboo, lazy, auto "
                                               "or all)"))
    return said_idle(changed_flags(parser, args), rules)


def check_depth(prof: Profile, stages: int) -> None:
    if stages < 2:
        raise ValueError(f"--stages must be at least 2 (got {stages})")
    if stages > prof.layers:
        raise ValueError(f"--stages {stages} is more than model {prof.name}'s {prof.layers} layers: "
                         "a stage holds one layer at least")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_finite(parser, args)
        check_not_a_file(args.plot, "--plot")
        options = options_from(args, model_spec.instance_of(args))
        model_spec.check_shape(args)
        jobs = jobs_of(args.jobs)
        if args.seeds < 1 or (args.nodes is not None and args.nodes < args.stages):
            raise ValueError("--seeds must be at least 1 and --nodes at least --stages")
        if args.checkpoint_formula == BEST and (args.sweep_rates or args.checkpoint_minutes):
            raise ValueError("--checkpoint-formula best searches the intervals of one trace: not with "
                             "--sweep-rates or --checkpoint-minutes")
        if args.sweep_rates and args.redundancy is not None:
            raise ValueError("--sweep-rates runs every strategy and mode: leave out --redundancy")
        for note in idle_notes(parser, args):
            print(f"bamboo-sim: note: {note}", file=sys.stderr)
        if args.sweep_rates:
            nodes = args.nodes or 3 * args.stages
            prof = model_of(args, nodes).profile
            check_depth(prof, args.stages)
            rows = sweep(prof, args.stages, nodes, args.seeds, options)
            out = {"model": args.model, "stages": args.stages, "nodes": nodes, "sweep": rows,
                   "notice_seconds": options.notice_seconds, "max_stages_per_node": options.max_stages,
                   "rollback": options.rollback, "frc": options.frc, "replica_sync": options.replica_sync,
                   "profile": prof.sources()}
            if args.plot:
                out["plots"] = [plot_sweep(rows, args.plot, f"{args.model}, P={args.stages}, {nodes} spot nodes")]
        else:
            out = simulate(args, options, jobs)
        out["run_seconds"] = round(time.perf_counter() - started, 2)  # this command's own, its imports aside
        print(json.dumps(out))
    except (TraceError, ValueError) as e:
        print(f"bamboo-sim: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
