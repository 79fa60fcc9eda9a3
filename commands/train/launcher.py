"""Local launch: an embedded etcd (unless one is given), P x D worker processes,
a progress bar, metrics, and cleanup of everything started, on exit or Ctrl-C.

The launcher reads the workers' iteration reports from etcd, checks that every
microbatch's loss arrived exactly once, and writes one JSON line per iteration.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

from agents.modes import epoch_setting
from agents.policy import nodes_for_a_pipeline
from commands.train.metrics import LaunchError, MetricsWriter, add_loss_scale, add_validation, iteration_record
from commands.train.progress import ProgressBar
from commands.train.process_clock import ProcessClock
from commands.train.regrow import Regrow
from bamboo.control.assignment import Assignment
from bamboo.control.changes import Changes
from bamboo.control.cluster import Cluster, in_force, latest
from bamboo.control.config import JobConfig, Surplus
from bamboo.control.access import enable_auth
from bamboo.control.credentials import ENV as TLS_ENV, ClientFiles, make_job_credentials
from bamboo.control.etcd import EtcdCluster, EtcdServer, connect, die_with_parent, embedded
from bamboo.control.events import (Event, FailedOver, ModeSwitched, NoticeSeen, Overflow, Preemption, Reconfigured,
                                   Redone)
from bamboo.control.exits import FENCED, RELEASED
from bamboo.control.protocol import (ASSIGNMENT, CONFIG, DONE, ERROR, FAILED, LOSS, MEMBERS, NOTICES, PREEMPTED, SCALE,
                                     START, VAL_LOSS)
from bamboo.runtime import WORKER
from bamboo.transport.devices import LOCAL_RANK

# The processes a launch starts, by module: a local cluster's agents (the layer
# above the runtime, started, not imported), or the workers (WORKER) of a job without agents.
AGENT = "agents.agent"

# Set by bamboo-train's SIGINT/SIGTERM handler.
INTERRUPTED = threading.Event()


@dataclass(frozen=True)
class LocalCluster:
    """N agents on this machine, node n in zone zones[n % len(zones)]; `joins`:
    (count, iteration) pairs: that many more nodes join once the iteration ends
    (their agents start with the others and register then)."""
    nodes: int
    zones: tuple[str, ...] = ("a",)
    joins: tuple[tuple[int, int], ...] = ()
    notice: str | None = None        # agents watch this cloud's preemption notices...
    metadata_url: str | None = None  # ...at this metadata service ("{node}" is replaced)
    hosts: int = 0                   # with hosts: `nodes` on this many machines of `per_host` nodes
    per_host: int = 1                # each (`bamboo-agent --workers`), machine h in zone zones[h % len(zones)]
    prefix: str = ""                 # each agent runs under this command ("{node}" is replaced)

    def command(self, node: int) -> list[str]:
        """The prefix of node `node`'s agent command (a network namespace, say)."""
        return shlex.split(self.prefix.replace("{node}", str(node)))

    def zone(self, node: int) -> str:
        return self.zones[node % len(self.zones)]

    def nodes_of(self, key: int) -> range:
        """The node ids of the process the launcher keeps under `key`: a machine's
        (with hosts, keyed by its first node) or the one node's."""
        return range(key, key + (self.per_host if self.hosts else 1))

    def zone_of(self, key: int) -> str:
        """The zone of the process under `key` (a machine's nodes share its zone)."""
        return self.zones[(key // self.per_host) % len(self.zones)] if self.hosts else self.zone(key)

    def host_args(self, host: int, name: str) -> list[str]:
        """The options of machine `host`'s agent (named `name`), whose nodes share its zone."""
        return ["--workers", str(self.per_host), "--host", name, *self.agent_args(host * self.per_host)[2:],
                "--zone", self.zones[host % len(self.zones)]]

    def agent_args(self, node: int) -> list[str]:
        """The options every agent of node `node` gets (beyond etcd, job and id)."""
        args = ["--zone", self.zone(node)]
        if self.notice:
            args += ["--notice", self.notice]
            if self.metadata_url:
                args += ["--metadata-url", self.metadata_url.replace("{node}", str(node))]
        return args

    def joiners(self) -> list[tuple[int, int]]:
        """(node, iteration) of every node that joins: ids after the first nodes',
        in the order of the iterations they join after."""
        found: list[tuple[int, int]] = []
        for count, it in sorted(self.joins, key=lambda join: join[1]):
            found += [(self.nodes + len(found) + k, it) for k in range(count)]
        return found


class Rewind(Exception):
    def __init__(self, assignment: Assignment):
        self.assignment = assignment


class Launcher:
    def __init__(self, cfg: JobConfig, etcd: str | None = None, metrics_out: str | None = None,
                 progress: bool = True, cluster: LocalCluster | None = None, named: bool = False,
                 sinks: tuple = (), etcd_members: int = 1):
        # A job is named by the user (`--job`: a second launcher may join it) or made unique.
        self.cfg = cfg if named else cfg.with_(job=f"{cfg.cluster.job}-{uuid.uuid4().hex[:8]}")
        self.named = named
        self.etcd, self.metrics = etcd, MetricsWriter(metrics_out, sinks)
        self.progress = progress
        self.local = cluster
        self._redone = 0  # the newest redo epoch already rewound to
        self._changes: Changes | None = None  # set by an etcd watch: a report, death, epoch or error
        self._noticed: set[int] = set()
        self._joiners: dict[int, int] = {}  # node -> the iteration it joins after, until that is recorded
        self._orphaned_since: float | None = None  # with agents: when every node started here was found gone
        self.server: EtcdServer | EtcdCluster | None = None
        self.etcd_members = etcd_members  # of the embedded etcd (no --etcd): a cluster named after the zones
        self.etcd_tls: str | None = None  # with --etcd: the credentials every process of the job presents
        self._own_tls = False     # made here for the embedded etcd: removed with it
        self.procs: dict[int, subprocess.Popen] = {}
        self.clock = ProcessClock()  # each agent's run, timed from outside: the local cluster's paid node-seconds
        self.slots: dict[int, int] = {}  # node -> its LOCAL_RANK, the device it takes (bamboo/transport/devices.py)
        self.on_tick = None    # called while waiting for iterations (a trace replay adds and kills nodes)
        # --surplus: released nodes said, and the ones the job asks for started (commands/train/regrow.py)
        self.regrow = Regrow(self, AGENT) if cluster and cfg.cluster.surplus != Surplus.KEEP else None
        self.stopped = False   # set by on_tick: stop after the current iteration, killing every process
        self.logs: str | None = None  # where the processes' logs go (default: a temp dir, removed after a clean run)
        self.keep_logs = False

    def run(self) -> dict:
        try:
            return self._run()
        except Exception:
            self.keep_logs = True  # the workers' tracebacks stay for the user (the error names them)
            raise
        finally:
            self.stop()
            self.metrics.close()  # what finished is written, even after an error

    def stop_processes(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()

    def stop(self) -> None:
        self.stop_processes()
        if self.server:
            self.server.stop()
        if self._own_tls:
            shutil.rmtree(self.etcd_tls, ignore_errors=True)
        if self.logs and not self.keep_logs:
            shutil.rmtree(self.logs, ignore_errors=True)

    def _run(self) -> dict:
        if self.etcd is None:
            self._start_etcd()
        tls = ClientFiles.in_dir(self.etcd_tls) if self.etcd_tls else None
        cluster = Cluster(self.etcd or self.server.endpoint, self.cfg.cluster.job, tls=tls)
        if tls is None:
            print(f"bamboo-train: note: etcd at {self.etcd} is used in the clear (no --etcd-tls): anyone who "
                  "reaches it can read and rewrite this job", file=sys.stderr)
        if self.logs:  # the user's: kept
            os.makedirs(self.logs, exist_ok=True)
            self.keep_logs = True
        else:
            self.logs = tempfile.mkdtemp(prefix="bamboo-logs-")
        if self.named and cluster.get(CONFIG()) is not None:
            return self._join(cluster)
        cluster.put(CONFIG(), self.cfg)
        self._start_nodes(cluster)
        start = time.monotonic()
        summary = {"iterations": 0, "samples": 0, "preemptions": 0, "failovers": 0}
        self._record_iterations(cluster, summary, start)
        if self.stopped:
            self.stop_processes()
        self._wait_exits(cluster)
        cluster.close()
        summary["total_seconds"] = round(time.monotonic() - start, 3)
        summary["mean_iteration_seconds"] = round(summary["total_seconds"] / max(1, summary["iterations"]), 4)
        if self.clock.spans:
            summary["agent_seconds"] = self.clock.seconds()
        self.metrics.write({"summary": summary})
        return summary

    def _wait_exits(self, cluster: Cluster) -> None:
        """Every process started has exited as expected. A node recorded dead whose
        process still runs (frozen, or cut off the network: a machine that vanished)
        is never waited for; it is stopped once the others are done."""
        dead = set(cluster.failed())
        gone = {k for k in self.procs if self.local and set(self.local.nodes_of(k)) <= dead}  # every node dead
        for k, p in self.procs.items():
            if k not in gone and p.wait() not in EXPECTED_EXITS:
                raise LaunchError(self._worker_error(cluster))
        for k in gone:
            try:  # an agent back from a partition, as a new node in standby, leaves by itself
                self.procs[k].wait(timeout=DEAD_GRACE)
            except subprocess.TimeoutExpired:
                self.procs[k].kill()
                self.procs[k].wait()

    def _start_nodes(self, cluster: Cluster) -> None:
        """A local cluster's agents (the joiners' too: they register once their
        iteration is done, not when they are ready); without agents, the workers of
        a static assignment."""
        if self.local and self.local.hosts:
            for h in range(self.local.hosts):
                self._start(cluster, h * self.local.per_host, AGENT, *self.local.host_args(h, f"host{h}"),
                            "--max-nodes", str(self.local.nodes), "--log-dir", self.logs)
        elif self.local:
            for n in range(self.local.nodes):
                self._start(cluster, n, AGENT, *self.local.agent_args(n), "--max-nodes",
                            str(self.local.nodes), "--log-dir", self.logs)
            self._joiners = dict(self.local.joiners())
            for n, after in self._joiners.items():
                self._start(cluster, n, AGENT, *self.local.agent_args(n), "--register-after", str(after),
                            "--log-dir", self.logs)
        else:
            cluster.put(ASSIGNMENT(0), Assignment.static(self.cfg.schedule.stages, self.cfg.schedule.pipelines))
            for n in range(self.cfg.schedule.nodes):
                self._start(cluster, n, WORKER)

    def _record_iterations(self, cluster: Cluster, summary: dict, start: float) -> None:
        """One metrics record per iteration, in order, as the reports come; an
        abandoned iteration is waited for again where the agents restart."""
        last = start
        it, redo = self._wait_start(cluster), []
        epoch = mode = None  # the epoch and redundancy mode of the last iteration recorded
        with ProgressBar(self.progress, self.cfg.schedule.iterations) as bar:
            while it < self.cfg.schedule.iterations and not self.stopped:
                try:
                    found = self._wait_iteration(cluster, it, since=last)
                except Rewind as r:  # abandoned: the agents redo it (or restart from a checkpoint)
                    redo.append(Redone(it, r.assignment.start, r.assignment.restore, r.assignment.why))
                    it = r.assignment.start
                    continue
                if found is None:
                    break  # stopped by on_tick
                now = time.monotonic()
                reports, failed, assignments = found
                preempted, notices, losses = cluster.read(PREEMPTED(), NOTICES(), LOSS(it))
                events, redo = redo + self._events_seen(it, reports, preempted, notices), []
                assignment = in_force(assignments, it)
                live = sum(n not in failed or failed[n].iteration > it for n in assignment.members)
                if assignment.epoch != epoch:
                    sch = self.cfg.schedule
                    epoch, before, mode = assignment.epoch, mode, epoch_setting(sch, assignment)
                    shares = [len(assignment.microbatches(sch.microbatches, j))
                              for j in range(len(assignment.pipelines))]
                    events.append(Reconfigured(epoch, assignment.pipelines, assignment.standby,
                                               assignment.mode(sch.redundancy), shares, sch.epoch_sync(assignment)))
                    if before not in (None, mode):  # --redundancy auto or --replica-sync auto switched
                        events.append(ModeSwitched(epoch, before, mode))
                record = iteration_record(self.cfg, it, losses, reports, now - last, live,
                                          [e.to_dict() for e in events])
                if self.cfg.recipe.loss_scaling:
                    add_loss_scale(record, cluster.get(SCALE(it)))
                if self.cfg.evaluates(it):
                    add_validation(self.cfg, record, cluster.children(VAL_LOSS(it)))
                self.metrics.write(record)
                last = now
                self._tally(summary, record, events, reports)
                bar(it, record)
                self._joiners = {n: after for n, after in self._joiners.items() if after > it}
                it += 1

    def _events_seen(self, it: int, reports: dict, preempted: dict, notices: dict) -> list[Event]:
        """The workers' failovers, the preemptions injected in iteration `it`, and
        each cloud notice the first time it is seen."""
        events = [Event.from_json(e) for r in reports.values() for e in r.events]
        events += [Preemption(n, round(time.time() - p.time, 4)) for n, p in preempted.items() if p.iteration == it]
        for n, notice in notices.items():
            if n not in self._noticed:
                self._noticed.add(n)
                events.append(NoticeSeen(n, notice.source, notice.action))
        return events

    def _tally(self, summary: dict, record: dict, events: list[Event], reports: dict) -> None:
        """The run's summary, after one more iteration."""
        summary["iterations"] += 1
        summary["samples"] += record["samples"]
        summary["preemptions"] += sum(isinstance(e, Preemption) for e in events)
        summary["failovers"] += sum(isinstance(e, FailedOver) for e in events)
        if self.cfg.recipe.loss_scaling:
            summary["skipped_steps"] = summary.get("skipped_steps", 0) + sum(
                e["type"] == Overflow.TYPE for e in record["events"])
        summary["peak_memory_mb"] = {str(n): r.rss_mb for n, r in reports.items()}
        summary["base_memory_mb"] = {str(n): r.base_rss_mb for n, r in reports.items()}  # before any layer
        sent = summary.setdefault("sent_bytes", {})  # by node, by kind: since each worker started
        sent.update({str(n): r.sent_bytes for n, r in reports.items()})
        if cuda := {str(n): r.cuda_mb for n, r in reports.items() if r.cuda_mb}:  # peak allocated
            summary["peak_cuda_mb"] = {**summary.get("peak_cuda_mb", {}), **cuda}

    def _start(self, cluster: Cluster, node: int, module: str, *args: str, named: bool = True) -> None:
        """A worker (or, for a local cluster, an agent) for `node` (with `named`
        False the agent claims the next free id and `node` only names its log)."""
        kind = "agent" if module == AGENT else "worker"
        width = self.local.per_host if module == AGENT and self.local and self.local.hosts else 1  # its workers
        held = {self.slots[n] + i for n, p in self.procs.items() if p.poll() is None for i in range(width)}
        # the lowest indexes no live process has: a machine's workers take LOCAL_RANK and the next ones
        self.slots[node] = min(s for s in range(len(held) + 1) if not held & set(range(s, s + width)))
        with open(os.path.join(self.logs, f"{kind}{node}.log"), "w") as log:
            prefix = self.local.command(node) if self.local and module == AGENT else []
            self.procs[node] = subprocess.Popen(
                [*prefix, sys.executable, "-m", module, "--etcd", cluster.endpoint, "--job", self.cfg.cluster.job,
                 *(["--node", str(node)] if named else []), *args], stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent, env={**os.environ, LOCAL_RANK: str(self.slots[node]),
                                                 **({TLS_ENV: self.etcd_tls} if self.etcd_tls else {})})
        if module == AGENT:
            self.clock.started(str(node), self.procs[node].pid)

    def _start_etcd(self) -> None:
        """The embedded etcd, secured for this job alone: a CA of its own, TLS with
        client certificates, and a role limited to the job's keys."""
        self.etcd_tls, self._own_tls = tempfile.mkdtemp(prefix="bamboo-tls-"), True
        make_job_credentials(self.etcd_tls, self.cfg.cluster.job)
        self.server = embedded(self.etcd_members, self.local.zones if self.local else ("a",),
                               tls_dir=self.etcd_tls).start()
        admin = connect(self.server.endpoint, tls=self.server.admin)
        try:
            enable_auth(admin, self.cfg.cluster.job)
        finally:
            admin.close()

    def _join(self, cluster: Cluster) -> dict:
        """The job runs already: add this machine's nodes to it, as agents that wait
        in standby until the policy gives them stages, and stay until they leave."""
        if not self.local:
            raise LaunchError(f"job {self.cfg.cluster.job!r} already exists: --local-nodes N joins it with N nodes")
        if not cluster.get(CONFIG()).cluster.elastic:
            raise LaunchError(f"job {self.cfg.cluster.job!r} runs without agents: it cannot take new nodes")
        if self.local.hosts:  # machines of their own names: ids are claimed, the names must be new too
            for h in range(self.local.hosts):
                self._start(cluster, h, AGENT, *self.local.host_args(h, f"join-{uuid.uuid4().hex[:6]}"), "--log-dir",
                            self.logs, named=False)
        for n in range(0 if self.local.hosts else self.local.nodes):
            self._start(cluster, n, AGENT, *self.local.agent_args(n), "--log-dir", self.logs, named=False)
        for p in self.procs.values():
            if p.wait() not in EXPECTED_EXITS:
                raise LaunchError(self._worker_error(cluster))
        return {"joined": self.cfg.cluster.job, "nodes": self.local.nodes}

    def _wait_start(self, cluster: Cluster) -> int:
        """The iteration the workers start from (0, or a checkpoint's)."""
        since = time.monotonic()
        while (first := cluster.get(START())) is None:
            self._check_start(cluster)
            self._check_workers(cluster, since, "the workers to start")
            time.sleep(0.05)
        return first.iteration

    def _check_start(self, cluster: Cluster) -> None:
        """Before the first configuration: fewer agents still running than one pipeline
        needs can never start the job, so say at once which nodes are missing."""
        if not self.local:
            return
        first = [k for k in self.procs if k not in self._joiners]
        running = [n for k in first if self.procs[k].poll() is None for n in self.local.nodes_of(k)]
        needed = nodes_for_a_pipeline(self.cfg.schedule.stages, self.cfg.schedule.max_stages_per_node)
        if len(running) >= needed or cluster.get(ASSIGNMENT(0)) is not None:
            return
        missing = ", ".join(f"{n} ({self.local.zone_of(k)})" for k in first for n in self.local.nodes_of(k)
                            if n not in running)
        total = sum(len(self.local.nodes_of(k)) for k in first)
        raise LaunchError(f"only {len(running)} of {total} nodes started (missing: {missing}); a pipeline of "
                          f"{self.cfg.schedule.stages} stages needs {needed} at --max-stages-per-node "
                          f"{self.cfg.schedule.max_stages_per_node} (logs: {self.logs})")

    def _check_workers(self, cluster: Cluster, since: float, what: str) -> None:
        if INTERRUPTED.is_set():  # Ctrl-C landed inside a gRPC call, which retried it away
            raise KeyboardInterrupt
        if any(p.poll() not in (None, *EXPECTED_EXITS) for p in self.procs.values()):
            raise LaunchError(self._worker_error(cluster))
        if all(p.poll() is not None for n, p in self.procs.items() if n not in self._joiners):
            self._check_orphaned(cluster, what)  # joiners not yet in, and agents started by others
        else:
            self._orphaned_since = None
        if time.monotonic() - since > self.cfg.faults.stall_timeout:
            raise LaunchError(f"gave up waiting for {what} after --stall-timeout "
                              f"{self.cfg.faults.stall_timeout:.0f} s (logs: {self.logs})")

    def _check_orphaned(self, cluster: Cluster, what: str) -> None:
        """Every process started here is gone. Without agents that ends the job. With
        agents, a machine started elsewhere (an autoscaler's replacement) may still be
        starting, unseen until its agent registers: wait REJOIN_GRACE for one."""
        if self._agents_elsewhere(cluster):
            self._orphaned_since = None
            return
        if not self.cfg.cluster.elastic or not self.local:
            raise LaunchError(f"every worker exited while waiting for {what}")
        now = time.monotonic()
        if self._orphaned_since is None:
            self._orphaned_since = now
            print(f"every node started here is gone; waiting up to {REJOIN_GRACE:.0f} s for an agent to join "
                  f"job {self.cfg.cluster.job!r}", file=sys.stderr, flush=True)
        elif now - self._orphaned_since > REJOIN_GRACE:
            raise LaunchError(f"every worker exited while waiting for {what}, and no agent joined within "
                              f"{REJOIN_GRACE:.0f} s (logs: {self.logs})")

    def _agents_elsewhere(self, cluster: Cluster) -> bool:
        """With agents, whether an agent this launcher did not start (a machine that
        joined the job) still runs a node: after a burst took every node started here,
        they restore the job from its checkpoint."""
        if not self.cfg.cluster.elastic or not self.local:
            return False
        own = {n for k in self.procs for n in self.local.nodes_of(k)}
        return any(n not in own for n in cluster.children(MEMBERS()))

    def _wait_iteration(self, cluster: Cluster, it: int, since: float) -> tuple[dict, dict, dict] | None:
        """The reports of iteration `it` once every node sent one (or died, and one did), with the
        deaths and the epochs read with them (one etcd read each time it looks); None
        if on_tick stopped the run; Rewind if the agents abandoned it meanwhile."""
        changed = self._changes or cluster.changes(DONE(), FAILED(), ASSIGNMENT(), ERROR())
        self._changes = changed
        while True:
            changed.take()  # lowered before the read (and armed again after an etcd restart)
            assignments, done, failed = cluster.read(ASSIGNMENT(), DONE(it), FAILED())
            newest = latest(assignments)
            if newest.redo and newest.start <= it and newest.epoch > self._redone:
                self._redone = newest.epoch
                raise Rewind(newest)
            members = in_force(assignments, it).members
            # Every member dead and none reported is no finished iteration: the agents
            # must write a redo epoch (a Rewind above), maybe once a replacement joins.
            if any(n in done for n in members) and all(n in done or n in failed for n in members):
                return done, failed, assignments
            self._check_workers(cluster, since, f"iteration {it} to finish")
            if self.regrow:
                self.regrow.tick(cluster)
            if self.on_tick:
                self.on_tick(self, cluster)
                if self.stopped:
                    return None
            # Off the critical path: woken by a report, a death, an epoch or an error
            # (an etcd watch), else every half second to look at the processes.
            # bamboo-chaos and bamboo-replay tick on their own clock.
            changed.wait(0.05 if self.on_tick else 0.5)

    def _worker_error(self, cluster: Cluster) -> str:
        """One line for the failure: a worker's own error, preferring a root cause
        over the time-outs it caused elsewhere, else the last line of a log."""
        errors = {n: e.message for n, e in cluster.children(ERROR()).items()}
        if errors:
            node = min(errors, key=lambda n: (errors[n].startswith("TimeoutError"), n))
            return f"worker {node} failed: {errors[node]} (logs: {self.logs})"
        for node, p in self.procs.items():
            if p.poll() not in (None, *EXPECTED_EXITS):
                kind = "agent" if self.local else "worker"
                with open(os.path.join(self.logs, f"{kind}{node}.log")) as f:
                    lines = f.read().strip().splitlines()
                return f"{kind} {node} exited with status {p.returncode}: {_last_error(lines)} (logs: {self.logs})"
        return "a worker failed"


def _last_error(lines: list[str]) -> str:
    """A log's last exception line (`SomeError: why`), else its last line."""
    found = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)]
    return (found or lines or ["no output"])[-1]


EXPECTED_EXITS = (0, -signal.SIGKILL, FENCED, RELEASED)  # done, preempted, fenced off by its peers, or released
REJOIN_GRACE = 60.0  # seconds a job whose every local node is gone waits for an agent started elsewhere
DEAD_GRACE = 10.0  # seconds the launcher waits, at the end, for the process of a node recorded dead
