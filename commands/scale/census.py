"""What etcd saw, counted from outside the nodes: a watch on the job's root that
tallies every write by key family and iteration, and etcd's own counters. Nothing here trusts the nodes' account of what
they wrote, so the harness's figures (and its test against a real job) do not
restate the code they measure."""
from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections import Counter, defaultdict

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import ITERATION_FAMILIES, job_root, parse

# etcd's request counters by gRPC method; its disk syncs, the events it sent its watchers and the watchers it holds
_METHOD = re.compile(r'^grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} (\S+)$')
WATCH_EVENTS, WATCHERS = "watch events", "watchers"
_SINGLE = {"etcd_disk_wal_fsync_duration_seconds_count": "fsyncs", "etcd_debugging_mvcc_events_total": WATCH_EVENTS,
           "etcd_debugging_mvcc_watcher_total": WATCHERS}  # etcd's name -> ours


class Census:
    """A watch on `job`'s keys from a client of its own. `writes[it][family]`: puts
    and deletes of an iteration's keys (families whose first part is the iteration),
    `revisions[it]`: the transactions that made them; `other[family]`: the rest."""

    def __init__(self, endpoint: str, job: str):
        self.cluster = Cluster(endpoint, job)
        self.writes: dict[int, Counter] = defaultdict(Counter)
        self.revisions: dict[int, set] = defaultdict(set)  # an iteration's etcd revisions: one per transaction
        self.other: Counter = Counter()
        self.events = 0
        self.revision = 0  # etcd's revision as of the last response handled
        self.lock = threading.Lock()
        self.watch = self.cluster.client.add_watch_prefix_callback(job_root(job), self._on_response)

    def _on_response(self, response) -> None:
        if response is None or isinstance(response, Exception):
            return
        with self.lock:
            self.revision = max(self.revision, response.header.revision)
            for event in response.events:
                self.events += 1  # every event etcd sent this watch
                found = parse(event.key.decode(errors="replace"))
                if found is None:
                    continue  # a process group's store key, below the job's root
                _, family, parts = found
                if family in ITERATION_FAMILIES and parts:
                    it = parts[0] if isinstance(parts, tuple) else parts
                    self.writes[it][family.name] += 1
                    self.revisions[it].add(event.mod_revision)
                else:
                    self.other[family.name] += 1

    def catch_up(self, timeout: float = 120.0) -> None:
        """Wait until every write etcd holds now has been counted (the watch's
        callback runs behind on a loaded machine)."""
        now = self.cluster.call(lambda: self.cluster.client.get_response(self.cluster.root)).header.revision
        deadline = time.monotonic() + timeout
        while self.revision < now:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the census counted up to etcd revision {self.revision} of {now} in {timeout} s")
            time.sleep(0.05)

    def per_iteration(self, iterations: range) -> dict[str, float]:
        """Mean writes per iteration by family over `iterations` (fault-free ones)."""
        with self.lock:
            total = Counter()
            for it in iterations:
                total.update(self.writes.get(it, Counter()))
        return {family: count / len(iterations) for family, count in sorted(total.items())}

    def transactions(self, iterations: range) -> float:
        """Mean etcd transactions per iteration that wrote its keys (a transaction of
        many keys is one revision, one raft entry, one disk sync)."""
        with self.lock:
            return sum(len(self.revisions.get(it, ())) for it in iterations) / len(iterations)

    def close(self) -> None:
        try:
            self.cluster.client.cancel_watch(self.watch)
        finally:
            self.cluster.close()


def etcd_counters(endpoint: str) -> Counter:
    """etcd's requests received by gRPC method, its WAL syncs, the events it sent to
    watchers (`WATCH_EVENTS`) and the watchers it holds (`WATCHERS`), from its /metrics page."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    found: Counter = Counter()
    for line in text.splitlines():
        if (m := _METHOD.match(line)) is not None:
            found[m[1]] += float(m[2])
        elif (name := line.split(" ", 1)[0]) in _SINGLE:
            found[_SINGLE[name]] = float(line.split()[1])
    return found


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds a process used so far (None: this one), from
    /proc: on a machine shared with other work, CPU per iteration is the figure
    that wall time cannot give."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
