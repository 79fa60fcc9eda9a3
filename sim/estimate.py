"""Dollars per billion tokens of one job, for every strategy, before it is launched.

The job's nodes are simulated on synthetic spot traces of its own size
(`sim.traces.synthetic`): preemptions at `Market.rate` per node-hour, a share
`Market.bursts` of them taking every node of the zone, whose capacity comes back
after `Market.burst_hours`. Twice: spread over the zones given, as the launch
places them, and all in the first zone. Spread, a burst takes a third of the
nodes and the replicas cover it, but every activation, replica sync and reduce
between zones is billed; in one zone nothing crosses and a burst stops the job
(nothing is paid, nothing trains, until the zone is back). Each strategy is
priced both ways (sim/pricing.py), and on-demand, which no burst touches, in one
zone: its best placement.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from agents.policy import next_config
from sim.options import Options
from sim.pricing import Charges, cross_zone_bytes, crossing_shares, priced, replica_share, sent
from sim.profiles import Profile
from sim.simulator import STRATEGIES, ClusterSimulator
from sim.traces import synthetic

SPREAD, ONE_ZONE = "spread", "one zone"
MAX_EVENTS = 200_000   # preemptions a trace may bring (each simulated six times over)


@dataclass(frozen=True)
class Market:
    """The spot market the estimate assumes."""
    rate: float = 0.2           # preemption events per node-hour
    bursts: float = 0.1         # the share of them that take every node of the zone
    burst_hours: float = 1.0    # mean wait for a zone's capacity after a burst took it
    hours: float = 24.0         # each trace's length
    seeds: int = 3              # traces per placement
    refill_seconds: float = 300.0  # mean wait for a replacement node

    def check(self, nodes: int) -> None:
        """ValueError naming the first flag out of range; a market of more than
        MAX_EVENTS preemptions a trace (the simulator's time) too."""
        if not 0 <= self.rate <= 100:
            raise ValueError(f"--preemption-rate must be from 0 to 100 per node-hour (got {self.rate})")
        if not 0 <= self.bursts <= 1:
            raise ValueError(f"--zone-bursts must be a share from 0 to 1 (got {self.bursts})")
        if not 0 <= self.burst_hours <= 24 * 30:
            raise ValueError(f"--burst-hours must be from 0 to 720 (got {self.burst_hours})")
        if not 0 < self.hours <= 24 * 366:
            raise ValueError(f"--estimate-hours must be above 0 and at most a year (got {self.hours})")
        if self.rate * self.hours * nodes > MAX_EVENTS:
            raise ValueError(f"--preemption-rate {self.rate:g} x --estimate-hours {self.hours:g} x {nodes} nodes is "
                             f"more than {MAX_EVENTS} preemptions a trace: fewer hours")

    def describe(self) -> dict:
        return dict(vars(self))


def _mean(runs: list[dict]) -> dict:
    """The seeds' runs averaged, in what pricing reads."""
    keys = ("hours", "throughput", "cost_per_hour", "preemptions", "fatal_failures")
    return {k: sum(r[k] for r in runs) / len(runs) for k in keys}


def _placements(zones: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The zones of each placement priced: spread (when there are several) and one."""
    return {SPREAD: zones, ONE_ZONE: zones[:1]} if len(zones) > 1 else {ONE_ZONE: zones}


def estimate(job: tuple[Profile, dict, int], nodes: int, depth: int, zones: tuple[str, ...], options: Options,
             charges: Charges, market: Market) -> dict:
    """placement -> strategy -> priced run; `job` = (profile, network bytes per
    iteration by kind, tokens per sample)."""
    profile, links, tokens = job
    options = replace(options, startup_seconds=charges.boot_seconds)
    out: dict[str, dict] = {}
    for placement, where in _placements(zones).items():
        traces = [synthetic(market.hours, nodes, where, market.rate, seed, market.bursts, market.refill_seconds,
                            market.burst_hours * 3600) for seed in range(market.seeds)]
        first = {e.node: e.zone for e in traces[0] if e.time == 0 and e.action == "add"}
        shares = crossing_shares(next_config(first, None, depth, profile.microbatches), first)
        arrivals = sum(e.action == "add" for t in traces for e in t) / len(traces)
        rows = {}
        steady = [synthetic(market.hours, nodes, where, 0.0, 0)]  # on-demand: its nodes, never preempted
        for strategy in STRATEGIES:
            if strategy == "on-demand" and placement != ONE_ZONE:
                continue
            runs = [ClusterSimulator(profile, depth, strategy, options).run(t, market.hours)
                    for t in (steady if strategy == "on-demand" else traces)]
            run = _mean(runs)
            on_demand = strategy == "on-demand"
            price = options.on_demand_price if on_demand else options.spot_price
            cross = cross_zone_bytes(sent(links, replica_share(strategy, runs)), shares)
            rows[strategy] = {**priced(run, nodes if on_demand else arrivals, price, tokens,
                                       profile.samples_per_iteration(), cross, charges),
                              "preemptions": round(run["preemptions"], 1),
                              "fatal_failures": round(run["fatal_failures"], 1)}
        out[placement] = rows
    return out


def cheapest(result: dict) -> tuple[str, str]:
    """(placement, strategy) of the fewest dollars per billion tokens."""
    found = [(row["dollars_per_billion_tokens"], placement, strategy) for placement, rows in result.items()
             for strategy, row in rows.items() if row["dollars_per_billion_tokens"] is not None]
    return min(found)[1:] if found else (ONE_ZONE, "on-demand")
