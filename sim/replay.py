"""`bamboo-replay TRACE`: drive a real local cluster (agents, workers, etcd) by a
preemption trace, compressed in time, and compare what it trained with what the
simulator predicts for the same slice.

    bamboo-replay TRACE [--start-hours A] [--hours H] [--speedup S] [--thin K] [--stages P] ...

The slice [A, A+H) of the trace runs S times faster: the nodes present at A start
as the local cluster; an `add` starts a `bamboo-agent`; a `remove` SIGKILLs the
agent of the node the trace names (its worker dies with it). `--thin K` keeps
every K-th node of the trace (in order of first appearance), so a trace of a large
cluster fits this machine at the same preemption rate per node. The trace clock
starts when the first iteration ends. The prediction uses the iteration times
this run measured for each number of pipelines (a measured profile) and the
simulator's pause model, over the same compressed events.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from commands.train.cli import check_writable
from commands.train.flag_checks import check_finite
from commands.train.launcher import AGENT, Launcher, LocalCluster
from bamboo.control.config import JobConfig
from bamboo.control.parser import OneLineParser
from bamboo.model.api import ModelSource
from sim.profiles import MeasuredProfile
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event, TraceError, read


def slice_trace(events: list[Event], start_s: float, seconds: float, thin: int, speedup: float) -> list[Event]:
    """Events of (start, start + seconds), every `thin`-th node only, with the
    nodes present at `start` (after its own events) added at 0 and times divided
    by `speedup`."""
    order: dict[str, int] = {}
    for e in events:
        order.setdefault(e.node, len(order))
    kept = [e for e in events if order[e.node] % thin == 0]
    present: dict[str, Event] = {}
    for e in kept:
        if e.time > start_s:
            break
        if e.action == "add":
            present[e.node] = e
        else:
            present.pop(e.node, None)
    out = [replace(e, time=0.0) for e in present.values()]
    out += [replace(e, time=(e.time - start_s) / speedup) for e in kept if start_s < e.time < start_s + seconds]
    return out


class Replay:
    def __init__(self, events: list[Event], duration: float, cfg: JobConfig, zones: tuple[str, ...]):
        self.duration, self.cfg = duration, cfg
        initial = [e for e in events if e.time == 0.0 and e.action == "add"]
        self.schedule = [e for e in events if not (e.time == 0.0 and e.action == "add")]
        self.zone_of = {e.node: e.zone or zones[i % len(zones)] for i, e in enumerate(initial)}
        self.ids = {e.node: i for i, e in enumerate(initial)}
        self.local = LocalCluster(len(initial), tuple(self.zone_of[e.node] for e in initial))
        self.zones = zones
        self.t0: float | None = None
        self.applied: list[tuple[float, str, int]] = []  # (seconds since t0, action, node id)

    def tick(self, launcher: Launcher, cluster) -> None:
        if self.t0 is None:
            if not launcher.metrics.lines:
                return
            self.t0 = time.monotonic()  # the first iteration ended: the trace starts
        now = time.monotonic() - self.t0
        while self.schedule and self.schedule[0].time <= now:
            e = self.schedule.pop(0)
            if e.action == "add":
                node = self.ids[e.node] = self.local.nodes + sum(a == "add" for _, a, _ in self.applied)
                zone = self.zone_of.setdefault(e.node, e.zone or self.zones[node % len(self.zones)])
                launcher._start(cluster, node, AGENT, "--zone", zone, "--log-dir", launcher.logs)
            else:
                node = self.ids[e.node]
                launcher.procs[node].kill()  # a real SIGKILL; the worker dies with its agent
            self.applied.append((now, e.action, node))
        if now >= self.duration:
            self.end = time.monotonic()
            launcher.stopped = True


def measure(records: list[dict], replay: Replay, spot_price: float) -> dict:
    """The replay's own figures, in the simulator's terms."""
    done = {}
    for r in records:
        done[r["iteration"]] = r
    iterations = sorted(done)
    lost = len(set(range(iterations[0], iterations[-1] + 1)) - set(iterations)) if iterations else 0
    elapsed = replay.end - replay.t0
    # records after the trace clock started (the first one ended it)
    samples = sum(done[i]["samples"] for i in iterations[1:])
    nodes, t, area = replay.local.nodes, 0.0, 0.0
    for at, action, _ in replay.applied:
        area += nodes * (at - t)
        nodes, t = nodes + (1 if action == "add" else -1), at
    area += nodes * (elapsed - t)
    mean_nodes = area / elapsed
    throughput = samples / elapsed
    return {"preemptions": sum(a == "remove" for _, a, _ in replay.applied),
            "fatal_failures": sum(e.get("restore") in ("checkpoint", "initial") for r in records for e in r["events"]
                                  if e["type"] == "redo"),
            "mean_nodes": round(mean_nodes, 3), "throughput": round(throughput, 4),
            "cost_per_hour": round(mean_nodes * spot_price, 3),
            "value": round(throughput / (mean_nodes * spot_price), 5), "samples": samples,
            "samples_lost": lost * replay.cfg.schedule.samples, "seconds": round(elapsed, 2)}


def profile_from(records: list[dict], cfg: JobConfig) -> MeasuredProfile:
    """Median iteration time per number of pipelines, from iterations without events."""
    by_d: dict[int, list[float]] = {}
    pipelines = 0
    for r in records:
        for e in r["events"]:
            if e["type"] == "reconfigure":
                pipelines = len(e["pipelines"])
        if not r["events"] and pipelines:
            by_d.setdefault(pipelines, []).append(r["seconds"] * 1000)
    medians = tuple((d, statistics.median(v)) for d, v in sorted(by_d.items()))
    return MeasuredProfile("measured", cfg.schedule.stages, medians, cfg.schedule.samples)


def check_args(ap, args) -> None:
    """Raise ValueError naming the first argument no replay could use."""
    check_finite(ap, args)
    for flag, ok, what in (("--speedup", args.speedup > 0, "positive"), ("--hours", args.hours > 0, "positive"),
                           ("--start-hours", args.start_hours >= 0, "0 or more"),
                           ("--thin", args.thin >= 1, "at least 1"), ("--stages", args.stages >= 2, "at least 2"),
                           ("--microbatches", args.microbatches >= 1, "at least 1"),
                           ("--seed", args.seed >= 0, "0 or more"),
                           ("--spot-price", args.spot_price > 0, "positive"),
                           ("--zones", all(args.zones.split(",")), "names separated by commas")):
        if not ok:
            raise ValueError(f"{flag} must be {what} (got {getattr(args, flag[2:].replace('-', '_'))!r})")
    if args.metrics_out:
        check_writable(args.metrics_out, "--metrics-out")
    ModelSource(args.model, args.seed)  # an unknown model: its ModelError, a ValueError, names it


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="bamboo-replay", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a preemption trace (traces/README.md)")
    ap.add_argument("--trace-format", choices=("ec2", "gcp", "events", "zone-counts", "auto"), default="auto",
                    help="the trace's format (auto: from its first lines)")
    ap.add_argument("--start-hours", type=float, default=0.0, help="where the slice starts, in trace hours")
    ap.add_argument("--hours", type=float, default=1.0, help="length of the slice, in trace hours")
    ap.add_argument("--speedup", type=float, default=60.0, help="trace seconds per wall second")
    ap.add_argument("--thin", type=int, default=1, help="keep every K-th node of the trace")
    ap.add_argument("--stages", type=int, default=2, help="pipeline depth P")
    ap.add_argument("--microbatches", type=int, default=8, help="global microbatches per iteration M")
    ap.add_argument("--model", default="tiny", help="as bamboo-train's --model")
    ap.add_argument("--zones", default="a,b,c", help="zones the trace's nodes are dealt to, when it names none")
    ap.add_argument("--seed", type=int, default=0, help="of the model and the samples")
    ap.add_argument("--spot-price", type=float, default=Options.spot_price, help="$ per node-hour, for the cost")
    ap.add_argument("--metrics-out", help="the job's metrics file (JSON lines)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(ap, args)
        events = slice_trace(read(args.trace, args.trace_format), args.start_hours * 3600, args.hours * 3600,
                             args.thin, args.speedup)
        if sum(e.time == 0.0 and e.action == "add" for e in events) < args.stages:
            raise ValueError(f"fewer than --stages {args.stages} nodes at the start of the slice (try --thin lower)")
    except (TraceError, ValueError) as e:
        print(f"bamboo-replay: error: {e}", file=sys.stderr)
        return 2
    duration = args.hours * 3600 / args.speedup
    cfg = JobConfig.of(name=args.model, stages=args.stages, microbatches=args.microbatches, iterations=10 ** 6,
                       seed=args.seed, elastic=True, job="replay", surplus="keep")  # the trace adds and removes
    zones = tuple(z for z in args.zones.split(",") if z)
    replay = Replay(events, duration, cfg, zones)
    launcher = Launcher(cfg, metrics_out=args.metrics_out, progress=False, cluster=replay.local)
    launcher.on_tick = replay.tick
    try:
        launcher.run()
    except Exception as e:  # noqa: BLE001 -- one line
        print(f"bamboo-replay: error: {e}", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in launcher.metrics.lines if "summary" not in line]
    result = measure(records, replay, args.spot_price)
    profile = profile_from(records, cfg)
    if not profile.iteration_ms:
        print("bamboo-replay: error: no iteration without events to measure (try a longer slice)", file=sys.stderr)
        return 1
    options = Options(spot_price=args.spot_price, reconfigure_seconds=0.0, failure_timeout=cfg.faults.failure_timeout,
                      startup_seconds=4.0, zones=zones, surplus="keep")  # the local cluster keeps every node
    predicted = ClusterSimulator(profile, cfg.schedule.stages, "bamboo", options).run(events, duration / 3600)
    predicted.pop("timeline")
    result["predicted"] = predicted
    result["throughput_ratio"] = round(result["throughput"] / predicted["throughput"], 4) \
        if predicted["throughput"] else None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
