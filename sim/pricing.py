"""What a spot job pays beyond its nodes' hours, and what a billion tokens cost.

The simulator's runs charge the nodes (sim/accounting.py). A cloud bill has more:
the nodes' boot (paid, not training), bytes sent from one zone to another (the
placement puts neighbouring stages in different zones on purpose, so that a zone
burst never takes a stage and its replica), the job's etcd instances and the
checkpoints kept in storage. `priced` adds them to a run and divides by its tokens.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agents.policy import Config, Priced, next_config
from agents.spread import pack_zones, zone_bursts_per_hour
from schedules.options import Redundancy
from sim.options import PACK, PRICED, Options
from sim.reconfiguration import used_nodes

GIB = 1 << 30   # the clouds price bytes per GiB (2^30)
HOURS_PER_MONTH = 730.0
KINDS = ("activations, forward", "input gradients, back", "replica syncs", "data-parallel reduce")
REPLICAS = ("bamboo", "lazy", "auto")   # the strategies that sync replicas


@dataclass(frozen=True)
class Charges:
    """A cloud's prices beyond node-hours, and what the job keeps in storage."""
    cross_zone_per_gib: float = 0.0    # $ per GiB sent between zones (EC2: 0.01 out of one, 0.01 into the other)
    etcd_per_hour: float = 0.0         # $ per hour of the job's etcd instances, on demand
    storage_per_gib_month: float = 0.0  # $ per GiB-month of checkpoint storage
    stored_gib: float = 0.0            # GiB of checkpoints kept
    boot_seconds: float = 0.0          # a node's paid time from its start until it can join

    def describe(self) -> dict:
        return dict(vars(self))


def crossing_shares(config: Config, zones: Mapping[str, str]) -> dict[str, float]:
    """The share of each kind of traffic that leaves its zone in `config`: stage s
    sends activations to s+1 and input gradients back, its gradients to its
    replica's holder (the node of stage s-1), and with D pipelines each stage's
    D nodes all-reduce around a ring in pipeline order."""
    pipes = [p for p in config.pipelines if len(p) > 1]
    boundaries = [(p[s], p[s + 1]) for p in pipes for s in range(len(p) - 1)]
    syncs = [(p[s], p[s - 1]) for p in pipes for s in range(len(p))]
    rings = [(pipes[j][s], pipes[(j + 1) % len(pipes)][s]) for s in range(config.depth) for j in range(len(pipes))] \
        if len(pipes) > 1 else []

    def share(pairs: list[tuple[str, str]]) -> float:
        return sum(zones[a] != zones[b] for a, b in pairs) / len(pairs) if pairs else 0.0
    return dict(zip(KINDS, (share(boundaries), share(boundaries), share(syncs), share(rings))))


def replica_share(strategy: str, runs: list[dict]) -> float:
    """The share of the time `strategy`'s replicas were synced: auto's by the hours
    it spent in eager and lazy."""
    if strategy != "auto":
        return float(strategy in REPLICAS)
    modes = [r["hours_per_mode"] for r in runs]
    synced = sum(m.get("eager", 0) + m.get("lazy", 0) for m in modes)
    return synced / max(sum(sum(m.values()) for m in modes), 1e-9)


def sent(links: Mapping[str, float], replicas: float) -> dict[str, float]:
    """Bytes per iteration by kind, the replica syncs for the share of the time they run."""
    return {k: v * replicas if k == "replica syncs" else v for k, v in links.items()}


def cross_zone_bytes(links: Mapping[str, float], shares: Mapping[str, float]) -> float:
    """Bytes per iteration that leave their zone."""
    return sum(count * shares.get(kind, 0.0) for kind, count in links.items())


def ledger_dollars(ledger: dict[str, float], price: float, paid: dict) -> dict[str, float]:
    """The ledger's node-hours at `price` a node-hour, beside what `priced` adds
    (`paid`: its dollars per hour, over the run's hours): the whole bill, by part."""
    hours = paid["hours"]
    out = {part: node_hours * price for part, node_hours in ledger.items()}
    out.update({part: paid["dollars_per_hour"][part] * hours for part in ("boot", "network", "etcd", "storage")})
    return {part: round(dollars, 4) for part, dollars in out.items() if dollars}


def priced(run: dict, arrivals: int, spot_price: float, tokens_per_sample: int, samples_per_iteration: int,
           cross_bytes: float, charges: Charges) -> dict:
    """`run` (a simulator summary; `arrivals` spot nodes started in it) in dollars
    per hour by what is paid for, and dollars per billion tokens trained."""
    hours = run["hours"]  # 0: a trace of no length, nothing paid by the hour
    tokens = run["throughput"] * tokens_per_sample
    iterations_per_hour = run["throughput"] * 3600 / samples_per_iteration
    per_hour = {"nodes": run["cost_per_hour"],
                "boot": arrivals * charges.boot_seconds / 3600 * spot_price / hours if hours else 0.0,
                "network": cross_bytes / GIB * charges.cross_zone_per_gib * iterations_per_hour,
                "etcd": charges.etcd_per_hour,
                "storage": charges.stored_gib * charges.storage_per_gib_month / HOURS_PER_MONTH}
    total = sum(per_hour.values())
    return {"tokens_per_second": round(tokens, 1), "hours": hours,
            "dollars_per_hour": {k: round(v, 4) for k, v in per_hour.items()},
            "total_per_hour": round(total, 4), "cross_zone_bytes_per_iteration": round(cross_bytes),
            "dollars_per_billion_tokens": round(total / (tokens * 3600) * 1e9, 2) if tokens else None}


def saved_by_packing(links: Mapping[str, float], spread: Config, packed: Config, zones: Mapping[str, str]) -> float:
    """Bytes per iteration between zones that `packed` sends fewer than `spread`."""
    return (cross_zone_bytes(links, crossing_shares(spread, zones))
            - cross_zone_bytes(links, crossing_shares(packed, zones)))


def packing_pays(sim, spread: Config, packed: Config) -> bool:
    """--zone-spread auto (agents/spread.py): the bytes between zones that packing
    `spread`'s pipelines (as `packed`) saves an hour, at --cross-zone-price, against
    the bursts of more than one node it survives less well. Spreading helps only
    where no pipeline has two nodes in one zone (more stages than zones: a zone's
    burst takes two of a pipeline either way, and that pipeline is redone) and only
    with redundancy (off redoes any death); there a burst packing puts on
    neighbours costs a redo from a peer pipeline (with one pipeline, a restart)
    instead of a failover."""
    if not sim.running(spread) or not sim.opt.zone_bytes:
        return False
    fails_over = sim.rules.redundancy != Redundancy.OFF  # off syncs no replica, and redoes any death
    links = {kind: count for kind, count in sim.opt.zone_bytes if fails_over or kind != "replica syncs"}
    saved = saved_by_packing(links, spread, packed, sim.zones)
    pipelines, used = len(spread.pipelines), len(used_nodes(spread))
    seconds = sim.iteration_seconds(pipelines)
    protects = fails_over and all(len({sim.zones[n] for n in set(p)}) == len(set(p)) for p in spread.pipelines)
    redo = sim.opt.failure_timeout + seconds + (sim.restart_seconds if pipelines == 1 else 0.0)
    failover = sim.iteration_seconds(pipelines, merged=True) - seconds
    lost = max(0.0, redo - failover) * used if protects else 0.0
    bursts = zone_bursts_per_hour(sim.bursts_seen(sim.state, used), sim.opt.acquire_seconds)
    return pack_zones(saved * 3600 / seconds, sim.opt.cross_zone_price, bursts, lost, sim.opt.spot_price)


def first_config(first: dict[str, str], depth: int, microbatches: int, options: Options,
                 links: dict[str, float]) -> Config:
    """The first configuration's placement, which the bill's bytes between zones
    follow: --zone-spread's, and under auto packed where it sends fewer of the
    `links` bytes between zones at a price (no burst of more than one node is seen
    yet, so spreading saves no failover yet: agents/spread.py)."""
    plan = lambda pack: next_config(first, None, depth, microbatches, priced=Priced(pack_zones=pack))  # noqa: E731
    if options.zone_spread != PRICED:
        return plan(options.zone_spread == PACK)
    spread, packed = plan(False), plan(True)
    saved = saved_by_packing(links, spread, packed, first)
    return packed if pack_zones(saved, options.cross_zone_price, 0.0, 0.0, options.spot_price) else spread
