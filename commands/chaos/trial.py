"""One bamboo-chaos trial: a real local job (its own etcd, `bamboo-train
--local-nodes` or `--local-hosts`), faults injected from outside at times drawn
from the trial's seed, every node killed replaced later as an autoscaler would,
and the verdict against the reference: losses, samples lost or trained twice,
processes left behind. commands/chaos/chaos.py runs the trials and prints the
table; commands/chaos/network.py adds the network's faults."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from commands.chaos.bursts import BURST_KINDS, Bursts
from commands.train.launcher import AGENT
from bamboo.control.etcd import EtcdError, EtcdServer, connect, die_with_parent, etcd_errors
from bamboo.control.protocol import DONE, scan
from bamboo.runtime import WORKER

KINDS = ("kill-node", "kill-worker", "pause", "etcd-restart", "zone-burst", "join") + BURST_KINDS
HOST_KINDS = KINDS + ("kill-host",)  # with machines of several nodes
NETWORK_KINDS = ("vanish", "partition", "etcd-cut", "etcd-member-kill")  # --network: commands/chaos/network.py
RTOL = 1e-9  # float64: the same math gives the same losses to rounding


@dataclass
class Settings:
    nodes: int = 7
    zones: tuple[str, ...] = ("a", "b", "c")
    stages: int = 3
    microbatches: int = 6
    iterations: int = 30    # the faults come in the first ~20 s of training
    faults: int = 4
    checkpoint_every: int = 10
    timeout: float = 600.0  # a trial that runs longer failed
    per_host: int = 1       # nodes per machine (bamboo-train --local-hosts); 1: each node a machine of its own
    network: bool = False   # each machine in its own network namespace, etcd of three members
    long_pause: float = 120.0  # a pause this long is a wait only a timeout ended: its logs are kept
    replica_sync: str = "end"  # bamboo-train --replica-sync

    @property
    def kinds(self) -> tuple[str, ...]:
        return (HOST_KINDS if self.per_host > 1 else KINDS) + (NETWORK_KINDS if self.network else ())

    @property
    def machines(self) -> list[int]:
        """The launcher's key of each machine (its first node's id)."""
        if self.per_host > 1:
            return [h * self.per_host for h in range(max(1, self.nodes // self.per_host))]
        return list(range(self.nodes))

    def cluster_args(self) -> list[str]:
        if self.per_host > 1:
            return ["--local-hosts", str(max(1, self.nodes // self.per_host)), "--workers-per-host", str(self.per_host)]
        return ["--local-nodes", str(self.nodes)]

    def train_args(self) -> list[str]:
        return ["--model", "tiny", "--dtype", "float64", "--seed", "3", "--stages", str(self.stages),
                "--microbatches", str(self.microbatches), "--iterations", str(self.iterations),
                "--replica-sync", self.replica_sync,
                "--surplus", "keep"]  # the faults are this driver's: no node released or started behind its back


@dataclass
class Outcome:
    seed: int
    faults: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds in, kind, detail)
    completed: bool = False
    equal: bool = False
    lost: int = 0
    repeated: int = 0
    orphans: int = 0
    pause: float = 0.0      # the longest iteration less the median one (the first record, start-up, aside)
    error: str = ""
    logs: str = ""

    @property
    def ok(self) -> bool:
        return self.completed and self.equal and not self.lost and not self.repeated and not self.orphans

    def keeps_logs(self, keep: bool, long_pause: float) -> bool:
        """A failed trial keeps its logs, and so does one that paused as long as only a
        timeout ends (its faults do not reproduce it alone: the logs are all there is)."""
        return keep or not self.ok or self.pause >= long_pause


def account(records: list[dict], iterations: int, samples: int) -> tuple[int, int]:
    """(samples lost, samples trained twice) from the metrics' iteration records: an
    iteration recorded again counts twice unless a checkpoint restore (a redo
    event) rewound the model before it."""
    applied: set[int] = set()
    repeated = 0
    for r in records:
        for e in r.get("events", []):
            if e["type"] == "redo" and e.get("restore") in ("checkpoint", "memory", "initial"):
                applied -= {i for i in applied if i >= e["from"]}
        if r["iteration"] in applied:
            repeated += samples
        applied.add(r["iteration"])
    return samples * (iterations - len(applied)), repeated


class Trial(Bursts):
    def __init__(self, settings: Settings, seed: int, directory: str, ref: list[float], keep: bool = False):
        self.settings, self.seed, self.dir, self.ref, self.keep = settings, seed, directory, ref, keep
        self.rng = random.Random(seed)
        self.outcome = Outcome(seed)
        self.etcd = EtcdServer(data_dir=os.path.join(directory, "etcd"))
        self.job = f"chaos-{seed}"
        self.launcher: subprocess.Popen | None = None
        self.extra: list[subprocess.Popen] = []     # agents this driver started (joins)
        self.seen: dict[int, psutil.Process] = {}   # every process of the job, ever
        self.paused: list[tuple[float, psutil.Process]] = []
        self.replace: list[tuple[float, str, int]] = []  # (when, zone, workers) of nodes (machines) to add
        self.t0 = 0.0
        self.client = None                          # the driver's etcd client, once training runs
        self._init_bursts()

    # -- the trial ---------------------------------------------------------------------
    def run(self) -> Outcome:
        os.makedirs(self.dir, exist_ok=True)
        self.etcd.start()
        try:
            self._start_job()
            self._drive()
            self._check()
        except Exception as e:  # noqa: BLE001 - the trial fails with its reason, the driver goes on
            self.outcome.error = f"{type(e).__name__}: {e}"
        finally:
            self._cleanup()
        if self.outcome.keeps_logs(self.keep, self.settings.long_pause):
            self.outcome.logs = self.dir
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        return self.outcome

    def _start_job(self) -> None:
        s = self.settings
        self.metrics = os.path.join(self.dir, "metrics.jsonl")
        cmd = [sys.executable, "-m", "commands.train.cli", *s.train_args(), "--etcd", self.etcd.endpoint,
               "--job", self.job, *s.cluster_args(), "--zones", ",".join(s.zones),
               "--checkpoint", os.path.join(self.dir, "ckpt"), "--checkpoint-every", str(s.checkpoint_every),
               "--no-progress", "--metrics-out", self.metrics, "--stall-timeout", str(s.timeout),
               "--log-dir", self.dir, *self._job_args()]  # every process's log stays with the trial's
        with open(os.path.join(self.dir, "launcher.log"), "w") as log:
            self.launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def _job_args(self) -> list[str]:
        """More of bamboo-train's flags (a subclass's)."""
        return []

    def _drive(self) -> None:
        """Inject the faults at their times, restore what needs restoring, and wait
        for the job to end (or the trial's time limit)."""
        client = self.client = self._client()
        while not self._training_started(client):
            self._watch()
            time.sleep(0.05)
        self.t0 = time.monotonic()
        at = self.t0 + self.rng.uniform(0.5, 3.0)
        injected = 0
        deadline = self.t0 + self.settings.timeout
        while self.launcher.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the job did not finish within {self.settings.timeout:.0f} s")
            if injected < self.settings.faults and now >= at:
                self._inject(self.rng.choice(self.settings.kinds))
                injected += 1
                at = now + self.rng.uniform(1.0, 6.0)
            self._due()
            self._fire_armed()
            self._watch()
            time.sleep(0.05)

    def _client(self, patience: float = 30.0):
        """A client of the trial's etcd, asked again while a loaded machine keeps it slow."""
        deadline = time.monotonic() + patience
        while True:
            try:
                return connect(self.etcd.endpoint)
            except EtcdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _training_started(self, client) -> bool:
        if self.launcher.poll() is not None:
            raise RuntimeError(f"the job exited with {self.launcher.returncode} before training")
        try:
            return any(family is DONE for _, family, _ in scan(client))
        except etcd_errors():  # a slow or changing etcd (a loaded machine, an election): ask again
            return False

    # -- faults ------------------------------------------------------------------------
    def _inject(self, kind: str) -> None:
        detail = getattr(self, "_" + kind.replace("-", "_"))()
        self.outcome.faults.append((round(time.monotonic() - self.t0, 2), kind, detail))

    def _agents(self) -> list[psutil.Process]:
        """The nodes' agents (not the machines' processes that start them)."""
        return [p for p in self._job_processes() if AGENT in " ".join(self._cmdline(p)) and not self._machine(p)]

    def _machine(self, p: psutil.Process) -> bool:
        cmd = self._cmdline(p)
        return "--workers" in cmd and cmd[cmd.index("--workers") + 1] != "1"

    def _kill_host(self) -> str:
        machine = self._pick([p for p in self._job_processes() if self._machine(p)])
        return "no machine to kill" if machine is None else self._kill_host_process(machine)

    def _kill_host_process(self, machine: psutil.Process) -> str:
        try:
            nodes, cmd, zone = [self._node(a) for a in machine.children()], self._cmdline(machine), self._zone_of(machine)
        except psutil.NoSuchProcess:
            return f"machine {machine.pid} already gone"
        self._signal(machine, signal.SIGKILL)  # its agents and their workers die with it
        self.replace.append((time.monotonic() + self.rng.uniform(1.0, 5.0), zone, self.settings.per_host))
        return f"{cmd[cmd.index('--host') + 1] if '--host' in cmd else machine.pid}: nodes {', '.join(nodes)}"

    def _worker_of(self, agent: psutil.Process) -> psutil.Process | None:
        try:
            return next((c for c in agent.children() if WORKER in " ".join(self._cmdline(c))), None)
        except psutil.NoSuchProcess:
            return None

    def _pick_worker(self) -> tuple[psutil.Process | None, psutil.Process | None]:
        """A running worker drawn at random, with its agent (its zone's)."""
        pairs = {w.pid: (a, w) for a in self._agents() if (w := self._worker_of(a))}
        worker = self._pick([w for _, w in pairs.values()])
        return pairs[worker.pid] if worker else (None, None)

    def _kill_node(self) -> str:
        agent = self._pick(self._agents())
        if agent is None:
            return "no node to kill"
        return self._kill(agent, with_worker=True)

    def _kill_worker(self) -> str:
        agent, worker = self._pick_worker()
        if worker is None:
            return "no worker to kill"
        node = self._node(worker)  # read before the process is gone
        self._signal(worker, signal.SIGKILL)
        self._replace_later(self._zone_of(agent))
        return f"worker {node}"

    def _pause(self) -> str:
        agent, worker = self._pick_worker()
        if worker is None:
            return "no worker to pause"
        seconds = self.rng.uniform(2.0, 10.0)
        self._signal(worker, signal.SIGSTOP)
        self.paused.append((time.monotonic() + seconds, worker))
        self._replace_later(self._zone_of(agent))
        return f"worker {self._node(worker)} for {seconds:.1f} s"

    def _etcd_restart(self) -> str:
        down = self.rng.uniform(0.5, 3.0)
        self.etcd.kill()
        time.sleep(down)  # etcd is down for this long: the fault itself, not a synchronisation
        self.etcd.start()
        return f"down {down:.1f} s"

    def _zone_burst(self) -> str:
        zone = self.rng.choice(self.settings.zones)
        agents = [a for a in self._agents() if self._zone_of(a) == zone]
        for agent in agents:
            self._kill(agent, with_worker=True)
        return f"zone {zone}: {len(agents)} nodes"

    def _join(self) -> str:
        zone = self.rng.choice(self.settings.zones)
        self._add_node(zone)
        return f"zone {zone}"

    def _kill(self, agent: psutil.Process, with_worker: bool) -> str:
        worker = self._worker_of(agent) if with_worker else None
        node, zone = self._node(agent), self._zone_of(agent)  # read before the process is gone
        if worker is not None and node.startswith("pid"):  # a joined agent claims its id: its worker names it
            node = self._node(worker)
        for p in (agent, worker):
            if p is not None:
                self._signal(p, signal.SIGKILL)
        self._replace_later(zone)
        return f"node {node}"

    def _replace_later(self, zone: str) -> None:
        self.replace.append((time.monotonic() + self.rng.uniform(1.0, 5.0), zone, 1))

    def _due(self) -> None:
        now = time.monotonic()
        for when, worker in [p for p in self.paused if p[0] <= now]:
            self._signal(worker, signal.SIGCONT)
            self.paused.remove((when, worker))
        for when, zone, workers in [r for r in self.replace if r[0] <= now]:
            self._add_node(zone, workers)
            self.replace.remove((when, zone, workers))

    def _add_node(self, zone: str, workers: int = 1) -> None:
        """A new node's agent, or a new machine of `workers` nodes."""
        if self.launcher.poll() is not None:
            return
        machine = ["--workers", str(workers), "--host", f"{self.job}-m{len(self.extra)}"] if workers > 1 else []
        log = open(os.path.join(self.dir, f"joined{len(self.extra)}.log"), "w")
        self.extra.append(subprocess.Popen(
            [*self._new_machine(), sys.executable, "-m", AGENT, "--etcd", self.etcd.endpoint, "--job", self.job,
             "--zone", zone, "--log-dir", self.dir, *machine],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
        log.close()

    def _new_machine(self) -> list[str]:
        """The command prefix of a machine that joins (a subclass's: its namespace)."""
        return []

    # -- processes ---------------------------------------------------------------------
    def _job_processes(self) -> list[psutil.Process]:
        roots = [p for p in [self.launcher, *self.extra] if p.poll() is None]
        out = []
        for root in roots:
            try:
                proc = psutil.Process(root.pid)
                out += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return out

    def _watch(self) -> None:
        for p in self._job_processes():
            self.seen.setdefault(p.pid, p)

    def _pick(self, procs):
        live = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_STOPPED]
        return self.rng.choice(sorted(live, key=lambda p: p.pid)) if live else None

    @staticmethod
    def _cmdline(p: psutil.Process) -> list[str]:
        try:
            return p.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return []

    def _zone_of(self, agent: psutil.Process) -> str:
        cmd = self._cmdline(agent)
        return cmd[cmd.index("--zone") + 1] if "--zone" in cmd else self.settings.zones[0]

    def _node(self, p: psutil.Process) -> str:
        cmd = self._cmdline(p)
        return cmd[cmd.index("--node") + 1] if "--node" in cmd else f"pid {p.pid}"

    @staticmethod
    def _signal(p: psutil.Process, sig: int) -> None:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass

    # -- the verdict -------------------------------------------------------------------
    def _check(self) -> None:
        o, s = self.outcome, self.settings
        if self.launcher.returncode != 0:
            tail = open(os.path.join(self.dir, "launcher.log")).read().strip().splitlines()[-1:]
            raise RuntimeError(f"the job exited with {self.launcher.returncode}: {tail}")
        records = [r for r in map(json.loads, open(self.metrics)) if "summary" not in r]
        o.completed = bool(records) and records[-1]["iteration"] == s.iterations - 1
        o.equal = all(abs(r["loss"] - self.ref[r["iteration"]]) <= RTOL * abs(self.ref[r["iteration"]])
                      for r in records)
        o.lost, o.repeated = account(records, s.iterations, s.microbatches * 2)
        seconds = [r["seconds"] for r in records[1:]]  # the first record holds the start-up
        o.pause = max(seconds) - statistics.median(seconds) if seconds else 0.0

    def _cleanup(self) -> None:
        """Wait briefly for the job's processes to leave by themselves (the ones
        left are orphans), then kill whatever is left."""
        for when, worker in self.paused:
            self._signal(worker, signal.SIGCONT)
        if self.launcher and self.launcher.poll() is None:
            self.launcher.kill()
        for p in self.extra:
            if p.poll() is None and self.launcher.returncode == 0:
                try:
                    p.wait(timeout=30)  # an agent in standby leaves once it sees the job done
                except subprocess.TimeoutExpired:
                    pass
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        self.outcome.orphans = len(alive)
        for p in alive:
            self._signal(p, signal.SIGKILL)
        for p in self.extra:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._stop_etcd()

    def _stop_etcd(self) -> None:
        self.etcd.kill()
