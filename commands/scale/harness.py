"""One run of the scale harness: N emulated nodes (emulator.py) against one real
etcd, fault-free iterations counted, then a burst of deaths at a boundary timed to
the survivors' agreement and to the agents' next epoch."""
from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig, Surplus
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ASSIGNMENT, CONFIG, FINISHED, REGROUP
from commands.scale.census import WATCH_EVENTS, WATCHERS, Census, cpu_seconds, etcd_counters
from commands.scale.fleet import InProcess, Processes

WARM = 2  # iterations left out of the per-iteration counts: the first epoch settling
POLL = 0.02  # how often the harness looks for the agreement and the next epoch after a burst
START_BATCH = 50  # emulated nodes started at once
# Building a thousand emulated nodes, one after the other, takes minutes: the first
# ones' leases must not lapse meanwhile for a main thread that is merely not started.
HANG_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Shape:
    """What one run emulates."""
    nodes: int
    stages: int = 4
    seconds: float = 1.0          # one iteration
    iterations: int = 10          # the job's length
    kill_at: int = 6              # the burst dies at this iteration's boundary (-1: none)
    burst: int = 1                # nodes in it, taken from one pipeline's neighbours of node 1
    failure_timeout: float = 3.0
    microbatches: int = 0         # 0: two per pipeline and stage
    processes: int = 1            # the emulator's processes (commands/scale/fleet.py)

    def config(self, job: str) -> JobConfig:
        pipelines = max(1, self.nodes // self.stages)
        return JobConfig.of(job=job, stages=self.stages, iterations=self.iterations, elastic=True,
                            microbatches=self.microbatches or 2 * self.stages * pipelines,
                            failure_timeout=self.failure_timeout, redundancy="eager", surplus=Surplus.KEEP,
                            hang_timeout=HANG_TIMEOUT)


@dataclass
class Result:
    shape: Shape
    pipelines: int = 0
    writes: dict = field(default_factory=dict)     # family -> keys written per fault-free iteration
    transactions: float = 0.0                      # etcd transactions (revisions) that wrote them, per iteration
    requests: dict = field(default_factory=dict)   # etcd gRPC method -> requests per fault-free iteration
    watch_events: float = 0.0                      # events etcd sent the nodes' watches per fault-free iteration
    start_events: float = 0.0                      # events it sent any watch from its start to the counted ones
    watchers: float = 0.0                          # the watches etcd held at the end of them (the census's one too)
    burst_events: float | None = None              # events it sent the nodes from the burst to the next epoch
    latency_ms: dict = field(default_factory=dict)  # p50, p99, max of every node's etcd requests
    iteration_s: float = 0.0                       # wall time of a fault-free iteration
    cpu_s: dict = field(default_factory=dict)      # CPU seconds per fault-free iteration: the emulator's, etcd's
    to_agreement_s: float | None = None            # the burst -> the regroup record naming it
    to_assignment_s: float | None = None           # the burst -> the agents' next epoch
    errors: list = field(default_factory=list)

    @property
    def writes_per_iteration(self) -> float:
        return sum(self.writes.values())


def run(shape: Shape, job: str = "scale") -> Result:
    """Start etcd and the nodes, run the job through its burst, and measure."""
    with EtcdServer() as etcd:
        cfg = shape.config(job)
        Cluster(etcd.endpoint, job).put(CONFIG(), cfg)
        census = Census(etcd.endpoint, job)
        fleet = None
        try:
            fleet = place(etcd.endpoint, job, shape)
            fleet.first_assignment(list(range(shape.nodes)))
            _start(fleet, shape)
            return _measure(shape, etcd, fleet, census, job)
        finally:
            if fleet is not None:
                fleet.close()
            census.close()


def place(endpoint: str, job: str, shape: Shape):
    """The nodes built where `shape.processes` says: this process, or child ones."""
    if shape.processes == 1:
        return InProcess(endpoint, job, list(range(shape.nodes)), shape.seconds)
    return Processes(endpoint, job, shape.nodes, shape.seconds, shape.processes)


def _start(fleet, shape: Shape) -> None:
    """Start the nodes a batch at a time, each batch once the one before began its
    first iteration: hundreds of threads starting at once in one process starve
    some lease's refreshes past the failure timeout (a real fleet's machines start
    on their own CPUs)."""
    for first in range(0, shape.nodes, START_BATCH):
        batch = list(range(first, min(shape.nodes, first + START_BATCH)))
        fleet.start(batch)
        _until(lambda seen: all(seen[n].started for n in batch), fleet, shape, 0.01)


def _measure(shape: Shape, etcd: EtcdServer, fleet, census: Census, job: str) -> Result:
    endpoint = etcd.endpoint
    reader = Cluster(endpoint, job)
    first = reader.latest_assignment()
    result = Result(shape, pipelines=len(first.pipelines))
    end = shape.kill_at if shape.kill_at >= 0 else shape.iterations
    working = first.members  # the rest wait in standby
    _until(lambda seen: min(seen[n].iteration for n in working) >= WARM - 1, fleet, shape)
    fleet.mark()
    before, began = etcd_counters(endpoint), time.monotonic()
    cpu = (fleet.cpu_seconds(), cpu_seconds(etcd.proc.pid))
    _until(lambda seen: min(seen[n].iteration for n in working) >= end - 1, fleet, shape)
    counted = end - WARM
    after, took = etcd_counters(endpoint), time.monotonic() - began
    result.cpu_s = {"emulator": round((fleet.cpu_seconds() - cpu[0]) / counted, 3),
                    "etcd": round((cpu_seconds(etcd.proc.pid) - cpu[1]) / counted, 3)}
    census.catch_up()
    result.writes = census.per_iteration(range(WARM, end))
    result.transactions = census.transactions(range(WARM, end))
    result.requests = {k: round((after[k] - before[k]) / counted, 1) for k in sorted(after)
                       if after[k] > before[k] and k not in (WATCH_EVENTS, WATCHERS)}
    result.watchers = after[WATCHERS]
    # the census's own watch hears each key written once: the rest went to the nodes
    result.watch_events = round((after[WATCH_EVENTS] - before[WATCH_EVENTS]) / counted - result.writes_per_iteration, 1)
    result.start_events = before[WATCH_EVENTS]  # the nodes' registration, the first epoch, the warm iterations
    result.latency_ms = _percentiles(fleet.latencies_since_mark())
    result.iteration_s = took / counted
    if shape.kill_at >= 0:
        _burst(shape, fleet, reader, result, census)
    result.errors = [f"node {n}: {p.error}" for n, p in sorted(fleet.progress().items()) if p.error]
    return result


def _burst(shape: Shape, fleet, reader: Cluster, result: Result, census: Census) -> None:
    """Kill the burst once its nodes' finished marks of `kill_at` are in, then look
    at etcd every POLL seconds (from this process) for the first regroup record
    that names the burst, and for the agents' next epoch; count the events etcd
    sent the nodes meanwhile (the census's own, one per key written, left out)."""
    epoch = reader.latest_assignment()
    victims = _victims(epoch, shape.burst)
    # etcd itself, not the census (whose callback runs behind on a loaded machine)
    _until(lambda _: all(reader.get(FINISHED(shape.kill_at, v)) for v in victims), fleet, shape, POLL)
    census.catch_up()
    sent = etcd_counters(reader.endpoint)[WATCH_EVENTS] - census.events
    killed = time.monotonic()
    fleet.kill(victims)
    survivors = [n for n in epoch.members if n not in victims]

    def seen(progress: dict) -> bool:
        now = time.monotonic() - killed
        if result.to_agreement_s is None and any(set(victims) <= set(r.failed)
                                                 for r in reader.children(REGROUP()).values()):
            result.to_agreement_s = now
        if result.to_assignment_s is None and reader.get(ASSIGNMENT(epoch.epoch + 1)) is not None:
            result.to_assignment_s = now
            total = etcd_counters(reader.endpoint)[WATCH_EVENTS]
            census.catch_up()
            result.burst_events = total - census.events - sent
        over = min(progress[n].iteration for n in survivors) >= shape.iterations - 1
        return over or (result.to_agreement_s is not None and result.to_assignment_s is not None)
    _until(seen, fleet, shape, POLL, only=set(survivors))


def _victims(epoch, burst: int) -> list[int]:
    """`burst` nodes of pipeline 0, never two neighbours (one pipeline absorbs those
    at a boundary), starting at its second node; then the next pipelines'."""
    order = [p[i] for p in epoch.pipelines for i in range(1, len(p), 2)]
    return sorted(order[:burst])


def _until(done, fleet, shape: Shape, poll: float = 0.05, only: set | None = None) -> None:
    """Wait until done(progress) (each node's); raise when a node (of `only`, if
    given) failed or it takes longer than the whole job should."""
    deadline = time.monotonic() + 60 + 5 * shape.seconds * shape.iterations
    while not done(progress := fleet.progress()):
        broken = sorted(n for n, p in progress.items() if p.error is not None and (only is None or n in only))
        if broken:
            raise RuntimeError(f"node {broken[0]} failed: {progress[broken[0]].error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the emulated job did not get there in time (nodes at iterations "
                               f"{Counter(p.iteration for p in progress.values())})")
        time.sleep(poll)


def _percentiles(seconds: list[float]) -> dict:
    if len(seconds) < 2:
        return {}
    ms = sorted(s * 1e3 for s in seconds)
    cuts = statistics.quantiles(ms, n=100)
    return {"p50": round(cuts[49], 2), "p99": round(cuts[98], 2), "max": round(ms[-1], 2), "count": len(ms)}
