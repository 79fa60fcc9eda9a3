"""`bamboo-launch ec2|gcp ... --estimate`: what the job would cost per billion
tokens under each strategy, its nodes spread over the zones or in one, on-demand
beside them; nothing is launched (sim/estimate.py does the arithmetic).

Besides the nodes (the instance table's prices, commands/train/instances.py) it
charges their boot, the bytes between zones, the etcd instances (`--etcd auto`)
and the checkpoints kept in the bucket, at the list prices below (US regions, as
published in 2025).
"""
from __future__ import annotations

import json
from dataclasses import replace

from bamboo.control.config import Precision
from cloud import ec2
from cloud.common import BadInput
from cloud.planning import gcp_row
from commands.train.instances import (GPU_TFLOPS, INSTANCES, Instance, InstanceError, gpu_flops, per_gpu_prices,
                                      with_prices)

CROSS_ZONE_PER_GIB = {"ec2": 0.02, "gcp": 0.01}  # EC2: 0.01 out of a zone, 0.01 into the other; GCP: 0.01
STORAGE_PER_GIB_MONTH = {"ec2": 0.023, "gcp": 0.020}  # S3 Standard, GCS Standard
ETCD_PER_HOUR = {"ec2": 0.0208, "gcp": 0.0168}  # an etcd member: t3.small, e2-small, on demand
NOTICE_SECONDS = {"ec2": 120.0, "gcp": 30.0}


DEFAULTS = {"preemption_rate": 0.2, "zone_bursts": 0.1, "burst_hours": 1.0, "boot_minutes": 5.0, "estimate_hours": 24.0,
            "prices": None}


def add_flags(c) -> None:
    g = c.add_argument_group("estimate (print the cost and exit: nothing is launched)")
    g.add_argument("--estimate", action="store_true",
                   help="print dollars per billion tokens for every strategy, the nodes spread over --zones and "
                        "in one zone, on-demand beside them (docs/cost.md)")
    g.add_argument("--preemption-rate", type=float, default=DEFAULTS["preemption_rate"], metavar="R",
                   help="with --estimate: spot preemptions per node-hour")
    g.add_argument("--zone-bursts", type=float, default=DEFAULTS["zone_bursts"], metavar="SHARE",
                   help="with --estimate: the share of preemptions that take every node of their zone")
    g.add_argument("--burst-hours", type=float, default=DEFAULTS["burst_hours"], metavar="H",
                   help="with --estimate: the mean wait for a zone's capacity after a burst took it")
    g.add_argument("--boot-minutes", type=float, default=DEFAULTS["boot_minutes"], metavar="M",
                   help="with --estimate: a node's paid minutes from its start to its joining (boot, install)")
    g.add_argument("--estimate-hours", type=float, default=DEFAULTS["estimate_hours"], metavar="H",
                   help="with --estimate: the length of each simulated trace (three traces per placement)")
    g.add_argument("--prices", metavar="FILE.json",
                   help='with --estimate: prices replacing the table\'s, {"g5.xlarge": {"spot": 0.4}}')


def check_flags(args) -> None:
    """A flag of the estimate without --estimate is refused: it would do nothing."""
    if args.estimate:
        if not 0 <= args.boot_minutes <= 120:
            raise BadInput(f"--boot-minutes must be from 0 to 120 (got {args.boot_minutes})")
        return
    for name, default in DEFAULTS.items():
        if getattr(args, name) != default:
            raise BadInput(f"--{name.replace('_', '-')} goes with --estimate")


def instances(args) -> list[Instance]:
    """The types the group may get, with --prices applied."""
    table = with_prices(args.prices) if args.prices else INSTANCES
    names = (args.instance_type or list(ec2.GPU_TYPES)) if args.command == "ec2" else [gcp_row(args)]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise InstanceError(f"--estimate: no price for {unknown[0]} (priced types: {', '.join(table)})")
    return [table[n] for n in names]


def group_kind(kinds: list[Instance]) -> Instance:
    """One instance standing for the group's: the slowest GPU sets the pipelines'
    pace, and the group pays the mean of its types' prices. The simulator's node is
    one GPU: a type of several (whose workers a preemption takes together) is
    refused."""
    several = [k for k in kinds if k.gpus > 1]
    if several:
        raise InstanceError(f"--estimate: {several[0].name} has {several[0].gpus} GPUs, whose workers a preemption "
                            "takes together; the estimate simulates one-GPU nodes: give a one-GPU type")
    slowest = min(kinds, key=lambda k: GPU_TFLOPS[k.gpu])
    spot, on_demand = per_gpu_prices(kinds)
    return replace(slowest, name=" / ".join(k.name for k in kinds), on_demand=on_demand, spot=spot)


def run_estimate(args, train_argv: list[str]) -> int:
    """Print the estimate's table and its JSON; no request is sent."""
    from cloud.bringup import zones_of
    from cloud.job import job_args
    from sim.estimate import Market, estimate
    from sim.job_model import job_model
    from sim.options import Options
    from sim.pricing import GIB, Charges
    _, cfg = job_args(train_argv, args.nodes, args.job, objects=False)
    zones = zones_of(args)
    if len(set(zones)) != len(zones):
        raise BadInput(f"--zones {args.zones}: a zone named twice")
    try:
        kind = group_kind(instances(args))
        market = Market(args.preemption_rate, args.zone_bursts, args.burst_hours, args.estimate_hours)
        market.check(args.nodes)
    except (InstanceError, ValueError) as e:
        raise BadInput(str(e)) from None
    job = job_model(cfg, args.nodes, gpu_flops(kind, cfg.recipe.precision is not Precision.FP32))
    keep = cfg.checkpoints.checkpoint_keep or 1
    charges = Charges(CROSS_ZONE_PER_GIB[args.command],
                      ETCD_PER_HOUR[args.command] * args.etcd_members if args.etcd == "auto" else 0.0,
                      STORAGE_PER_GIB_MONTH[args.command],
                      job.checkpoint_bytes * keep / GIB if cfg.checkpoints.checkpoint else 0.0,
                      args.boot_minutes * 60)
    options = Options(spot_price=kind.spot, on_demand_price=kind.on_demand,
                      notice_seconds=NOTICE_SECONDS[args.command], surplus=cfg.cluster.surplus)  # as the launch will
    result = estimate((job.profile, job.links, job.tokens_per_sample), args.nodes, cfg.schedule.stages, zones,
                      options, charges, market)
    print("\n".join(describe(result, kind, zones, job, market, charges)))
    if cfg.checkpoints.checkpoint and not cfg.checkpoints.checkpoint_keep:
        print("note: --checkpoint-keep 0 keeps every checkpoint: storage is priced for one, and grows")
    print(json.dumps({"estimate": result, "instance": vars(kind), "zones": list(zones), "nodes": args.nodes,
                      "stages": cfg.schedule.stages, "market": market.describe(), "charges": charges.describe(),
                      "job": job.describe()}))
    return 0


def _cell(row: dict | None) -> str:
    if row is None:
        return f"{'-':>30}"
    per_b = row["dollars_per_billion_tokens"]
    money = f"${per_b:,.2f}" if per_b is not None else "no tokens"
    return f"{money:>11} {row['tokens_per_second']:>9,.0f} ${row['dollars_per_hour']['network']:>8,.2f}"


def describe(result: dict, kind: Instance, zones: tuple[str, ...], job, market, charges) -> list[str]:
    """The estimate as the lines it prints: a row per strategy, a column per placement."""
    from sim.estimate import ONE_ZONE, SPREAD, cheapest
    p = job.profile
    names = {SPREAD: f"spread over {', '.join(zones)}", ONE_ZONE: f"all in {zones[0]}"}
    out = [f"estimate: {p.name}, {p.params / 1e6:,.1f}M parameters; {kind.name} ({kind.gpu}, spot ${kind.spot:g}/h, "
           f"on demand ${kind.on_demand:g}/h); M={p.microbatches}, batch {p.microbatch} x seq {p.seq}",
           f"market: {market.rate:g} preemptions per node-hour, {market.bursts:.0%} of them a whole zone for "
           f"{market.burst_hours:g} h; "
           f"{market.seeds} traces of {market.hours:g} h per placement; boot {charges.boot_seconds / 60:g} min",
           f"charges: between zones ${charges.cross_zone_per_gib:g}/GiB; etcd ${charges.etcd_per_hour:g}/h; "
           f"checkpoints {charges.stored_gib:.1f} GiB at ${charges.storage_per_gib_month:g}/GiB-month",
           "per placement: $ per billion tokens, tokens/s, network $/h",
           " " * 14 + "".join(f"  {names[k]:>30}" for k in result)]
    for strategy in dict.fromkeys(s for rows in result.values() for s in rows):
        out.append(f"  {strategy:12}" + "".join(f"  {_cell(rows.get(strategy))}" for rows in result.values()))
    placement, strategy = cheapest(result)
    out.append(f"cheapest: {strategy} {names[placement]}" +
               (f" (give --zones {zones[0]})" if placement == ONE_ZONE and len(zones) > 1 else ""))
    if len(result) > 1:
        for s in ("bamboo", "redo"):
            spread, one = (result[k][s]["dollars_per_billion_tokens"] for k in (SPREAD, ONE_ZONE))
            if spread and one:
                rows = {k: result[k][s] for k in (SPREAD, ONE_ZONE)}
                win, lose = (SPREAD, ONE_ZONE) if spread <= one else (ONE_ZONE, SPREAD)
                out.append(f"{s}: {names[win]} costs less, ${rows[win]['dollars_per_billion_tokens']:,.2f} against "
                           f"${rows[lose]['dollars_per_billion_tokens']:,.2f} per billion tokens, at "
                           f"{rows[win]['tokens_per_second']:,.0f} against {rows[lose]['tokens_per_second']:,.0f} "
                           "tokens/s")
    return out
