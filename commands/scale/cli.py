"""bamboo-scale: the control plane of N emulated nodes against one real local etcd.

The nodes are commands/scale/emulator.py's, spread over --processes; for each N asked: etcd writes per iteration
(keys by family, and the transactions that wrote them, counted by a watch of its
own), etcd's requests per iteration and the events it sent to watchers (its own
counters; the events also from its start: the nodes' registration and first epoch),
the latency of every node's
etcd requests, the CPU seconds per iteration of the emulator and of etcd, and,
after a burst of deaths at an iteration's boundary, the time to the survivors'
agreement and to the agents' next epoch.

    bamboo-scale --nodes 10,100 [--stages 4] [--iteration-seconds 1] [--iterations 10]
        [--kill-at 6] [--burst 1] [--failure-timeout 3] [--processes auto] [--json OUT]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

from bamboo.control.parser import OneLineParser
from commands.scale.fleet import quiet_killed
from commands.scale.harness import Result, Shape, run

MOST_NODES = 5000
MOST_PROCESSES = 64
NODES_PER_PROCESS = 150  # --processes auto: a process per this many nodes, at most one per CPU


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="bamboo-scale", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100", help="comma-separated node counts, one run each")
    p.add_argument("--stages", type=int, default=4, help="pipeline depth P")
    p.add_argument("--iteration-seconds", type=float, default=1.0, help="one iteration's time")
    p.add_argument("--iterations", type=int, default=10, help="the job's length")
    p.add_argument("--kill-at", type=int, default=6,
                   help="the burst dies at this iteration's boundary; -1: no deaths")
    p.add_argument("--burst", type=int, default=1, help="nodes killed at once")
    p.add_argument("--failure-timeout", type=float, default=3.0, help="a silent lease this old is dead")
    p.add_argument("--processes", default="auto",
                   help="processes the emulated nodes are shared out over (auto: one per "
                        f"{NODES_PER_PROCESS} nodes, at most one per CPU)")
    p.add_argument("--json", metavar="OUT", help="also write every figure to OUT (JSON)")
    return p


def shapes(args) -> list[Shape]:
    """The runs asked for; ValueError naming the first flag that cannot be."""
    try:
        counts = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        raise ValueError(f"--nodes: a comma-separated list of node counts (got {args.nodes!r})") from None
    if args.stages < 2:
        raise ValueError(f"--stages must be at least 2 (got {args.stages})")
    if any(not args.stages <= n <= MOST_NODES for n in counts):
        raise ValueError(f"--nodes: each count between --stages ({args.stages}) and {MOST_NODES} (got {args.nodes})")
    if not 0.1 <= args.iteration_seconds <= 600:
        raise ValueError(f"--iteration-seconds must be between 0.1 and 600 (got {args.iteration_seconds})")
    if not 4 <= args.iterations <= 10_000:
        raise ValueError(f"--iterations must be between 4 and 10000 (got {args.iterations})")
    if args.kill_at != -1 and not 3 <= args.kill_at < args.iterations - 1:
        raise ValueError(f"--kill-at must be -1 or between 3 and --iterations - 2 (got {args.kill_at})")
    if not 1 <= args.burst <= min(counts) // 2:
        raise ValueError(f"--burst must be between 1 and half the fewest nodes (got {args.burst})")
    if not 0.5 <= args.failure_timeout <= 600:
        raise ValueError(f"--failure-timeout must be between 0.5 and 600 (got {args.failure_timeout})")
    return [Shape(n, args.stages, args.iteration_seconds, args.iterations, args.kill_at, args.burst,
                  args.failure_timeout, processes=processes(args.processes, n)) for n in counts]


def processes(asked: str, nodes: int) -> int:
    """The emulator's processes for a run of `nodes`; ValueError for a bad --processes."""
    if asked == "auto":
        return max(1, min(os.cpu_count() or 1, nodes // NODES_PER_PROCESS))
    try:
        count = int(asked)
    except ValueError:
        raise ValueError(f"--processes: a count or auto (got {asked!r})") from None
    if not 1 <= count <= MOST_PROCESSES:
        raise ValueError(f"--processes must be auto or between 1 and {MOST_PROCESSES} (got {count})")
    return min(count, nodes)


def row(r: Result) -> str:
    lat, s = r.latency_ms, r.shape
    timed = (f"{r.to_agreement_s:.2f} s" if r.to_agreement_s is not None else "-",
             f"{r.to_assignment_s:.2f} s" if r.to_assignment_s is not None else "-")
    return (f"{s.nodes:>6} {r.pipelines:>5} {r.writes_per_iteration:>8.1f} {r.transactions:>7.1f} "
            f"{r.transactions / max(1, r.pipelines):>9.1f} {sum(r.requests.values()):>9.0f} "
            f"{lat.get('p50', 0):>7.2f} {lat.get('p99', 0):>7.2f} {r.iteration_s:>7.2f} {timed[0]:>10} {timed[1]:>10} "
            f"{r.cpu_s.get('emulator', 0):>8.2f} {r.cpu_s.get('etcd', 0):>8.2f} {s.processes:>5} "
            f"{r.watch_events:>9.0f} {r.start_events:>12.0f}")


def main(argv: list[str] | None = None) -> int:
    threading.excepthook = quiet_killed
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        runs = shapes(args)
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json!r}: its directory does not exist")
    except ValueError as e:
        parser.error(str(e))
    first = runs[0]
    deaths = f"burst of {first.burst} at iteration {first.kill_at}'s boundary" if first.kill_at >= 0 else "no deaths"
    print(f"bamboo-scale: P={first.stages}, {first.seconds} s iterations, {first.iterations} iterations, "
          f"{deaths}, --failure-timeout {first.failure_timeout}; "
          f"one etcd member on this machine ({os.cpu_count()} CPUs); every node a worker and an agent", flush=True)
    print(f"{'nodes':>6} {'pipes':>5} {'keys/it':>8} {'txns/it':>7} {'per pipe':>9} {'requests':>9} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'it s':>7} {'agreement':>10} {'next epoch':>10} {'emu cpu':>8} {'etcd cpu':>8} {'procs':>5} "
          f"{'events/it':>9} {'start events':>12}",
          flush=True)
    results, began, failed = [], time.monotonic(), False
    for shape in runs:
        try:
            result = run(shape)
        except (RuntimeError, TimeoutError) as e:  # a node failed, or the job fell behind: said, then the next
            print(f"{shape.nodes:>6} did not finish: {e}", flush=True)
            failed = True
            continue
        results.append(result)
        print(row(result), flush=True)
        for error in result.errors:
            print(f"  {error}", flush=True)
    for r in results:
        print(f"  N={r.shape.nodes}: writes/it by family {r.writes}; requests/it by method {r.requests}; "
              f"{r.watchers:.0f} watches held" + (f"; {r.burst_events:.0f} events sent from the burst to the next "
                                                   "epoch" if r.burst_events is not None else ""), flush=True)
    print(f"bamboo-scale: {time.monotonic() - began:.0f} s in all", flush=True)
    if args.json:
        _write_json(args.json, results)
    return 1 if failed or any(r.errors for r in results) else 0


def _write_json(path: str, results: list[Result]) -> None:
    """Every figure, whole: a temp file, then a rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([{**dataclasses.asdict(r), "writes_per_iteration": r.writes_per_iteration} for r in results], f,
                  indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
