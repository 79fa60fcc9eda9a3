"""How long the reconfiguration policy (agents/policy.py `next_config`) takes to
decide for a fleet of N live nodes: whether it keeps up at a thousand nodes.

Each N gets a generated fleet: nodes dealt over --zones zones, a --shared share
of them on machines of --workers workers (the rest one to a machine, each
machine in one zone), short pipelines on (--max-stages 2) with the stage-slot
estimate of --per-pipeline microbatches per full pipeline, the nodes no pipeline
uses released (the surplus rule on: `Priced.per_node`), zones spread or, with
--pack, packed. Two decisions are timed:

  fresh   the first configuration (no previous one)
  after   the next one, once --dead of the nodes have died (a zone burst: the
          dead are taken from one zone first) and --joined newcomers have come
  cornered  the hole search's worst case: one zone, one node a machine but for
          machine H; up to 120 pipelines each lose their stage-3 node, the second
          half of them have stage 2 on H, and the newcomers are half on H, half on
          machines of their own. A fill that keeps H apart exists (H's newcomers in
          the first half's holes), but the search, trying newcomers in name order,
          does not find it within its bound and falls back to the greedy choice.

Each is run --rounds times; the median and the fastest are printed, in seconds.

    python scripts/bench_policy.py [--nodes 10,100,300,1000] [--depth 7] [--zones 4]
        [--shared 0.25] [--workers 4] [--per-pipeline 4] [--dead 0.05] [--joined 0.02]
        [--rounds 5] [--seed 0] [--pack]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fleet(rng: random.Random, nodes: int, zones: int, shared: float, workers: int):
    """live (node -> zone) and hosts (node -> machine) of `nodes` nodes, `shared` of
    them on machines of `workers`."""
    live, hosts, n = {}, {}, 0
    while n < nodes:
        size = min(workers if rng.random() < shared else 1, nodes - n)
        zone = f"z{rng.randrange(zones)}"
        machine = f"h{n:05d}"
        for _ in range(size):
            live[f"n{n:05d}"], hosts[f"n{n:05d}"] = zone, machine
            n += 1
    return live, hosts


def after(rng: random.Random, live: dict, hosts: dict, dead: float, joined: float):
    """The fleet once `dead` of it died (one zone's nodes first) and `joined` newcomers came."""
    burst = sorted(live, key=lambda n: (live[n] != "z0", rng.random()))[:round(dead * len(live))]
    now = {n: z for n, z in live.items() if n not in burst}
    new_hosts = {n: h for n, h in hosts.items() if n in now}
    for i in range(round(joined * len(live))):
        now[f"j{i:05d}"] = f"z{rng.randrange(len(set(live.values())))}"
    return now, new_hosts


def cornered(decide, nodes: int, depth: int):
    """(live, hosts, previous) of the `cornered` decision (module docstring)."""
    live = {f"n{i:05d}": "z0" for i in range(nodes)}
    hosts = {n: n for n in live}
    previous = decide(live, None, hosts)
    full = [p for p in previous.pipelines if len(set(p)) == depth]
    k = min(len(full), 120) // 2
    for pipe in full[k:2 * k]:
        hosts[pipe[2]] = "H"
    now = {n: z for n, z in live.items() if n not in {p[3] for p in full[:2 * k]}}
    for i in range(k):
        now[f"x{i:05d}"], now[f"y{i:05d}"] = "z0", "z0"
        hosts[f"x{i:05d}"], hosts[f"y{i:05d}"] = f"x{i:05d}", "H"
    return now, hosts, previous


def timed(call, rounds: int) -> tuple[float, float]:
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), min(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="10,100,300,1000")
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--zones", type=int, default=4)
    ap.add_argument("--shared", type=float, default=0.25)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-pipeline", type=int, default=4)
    ap.add_argument("--dead", type=float, default=0.05)
    ap.add_argument("--joined", type=float, default=0.02)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pack", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from agents.policy import Priced, next_config, slot_estimate

    print(f"depth={a.depth} zones={a.zones} shared={a.shared} workers={a.workers} max_stages=2 "
          f"per_pipeline={a.per_pipeline} dead={a.dead} joined={a.joined} rounds={a.rounds} seed={a.seed} "
          f"per_node=True pack_zones={a.pack}")
    print(f"{'N':>6} {'M':>6} {'pipelines':>9} {'fresh_med':>10} {'fresh_min':>10} {'after_N':>7} "
          f"{'after_med':>10} {'after_min':>10} {'cornered_med':>12}")
    priced = Priced(per_node=True, pack_zones=a.pack)
    for nodes in (int(x) for x in a.nodes.split(",")):
        rng = random.Random(a.seed * 1_000_003 + nodes)
        live, hosts = fleet(rng, nodes, a.zones, a.shared, a.workers)
        M = a.per_pipeline * max(1, nodes // a.depth)
        decide = lambda now, prev, h: next_config(now, prev, a.depth, M, 2, slot_estimate(M),  # noqa: E731
                                                  hosts=h, priced=priced)
        first = decide(live, None, hosts)
        now, now_hosts = after(rng, live, hosts, a.dead, a.joined)
        fresh = timed(lambda: decide(live, None, hosts), a.rounds)
        later = timed(lambda: decide(now, first, now_hosts), a.rounds)
        worst, worst_hosts, before = cornered(decide, nodes, a.depth)
        corner = timed(lambda: decide(worst, before, worst_hosts), a.rounds)
        print(f"{nodes:>6} {M:>6} {len(first.pipelines):>9} {fresh[0]:>10.4f} {fresh[1]:>10.4f} {len(now):>7} "
              f"{later[0]:>10.4f} {later[1]:>10.4f} {corner[0]:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
