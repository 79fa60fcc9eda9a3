"""bamboo-chaos --network: the faults of real fleets, on one Linux box.

Each machine of the job (an agent, or a machine's agents, with their workers)
runs in its own network namespace, and etcd is three members, each in a
namespace of its own (commands/chaos/netlab.py). Beside the usual kinds this
trial injects:

  vanish            a machine's processes frozen and its link cut at once: no
                    FIN, no RST, never back (its processes are killed once its
                    nodes are recorded dead, the link still cut)
  partition         a machine's link cut for a few seconds, then healed: it
                    comes back fenced, as a new standby node, or unharmed
  etcd-cut          a machine cut off from every etcd member (its peers still
                    reach it), then reconnected
  etcd-member-kill  the etcd leader SIGKILLed, restarted a few seconds later

and `etcd-restart` takes two of the three members away (no quorum: the job
pauses) and brings them back.
"""
from __future__ import annotations

import os
import signal
import time

import psutil

from commands.chaos.trial import Trial
from commands.chaos.netlab import NetLab
from bamboo.control.etcd import EtcdCluster, EtcdError

MEMBERS = 3


class NetworkTrial(Trial):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lab = NetLab()
        self.machine_of: dict[int, str] = {}          # a machine's root process (pid) -> its lab name
        self.later: list[tuple[float, object]] = []   # (when, action): heals, restarts, reaping
        self.vanished: list[psutil.Process] = []      # the processes of machines gone for good
        self.faulted: set[str] = set()                # machines cut, cut off or gone: no second fault on them

    # -- set-up: the lab, etcd's members, the job's machines -----------------------------
    def run(self):
        try:
            self.lab.start()
            for key in self.settings.machines:
                self.lab.add(f"n{key}")
            members = [self.lab.add(f"etcd{i}") for i in range(MEMBERS)]
            self.etcd = EtcdCluster.in_zones(MEMBERS, self.settings.zones, [m.address for m in members],
                                             prefixes=[tuple(self.lab.command(m.name)) for m in members],
                                             data_dirs=[os.path.join(self.dir, f"etcd{i}") for i in range(MEMBERS)])
            return super().run()
        finally:
            self.lab.close()

    def _job_args(self) -> list[str]:
        template = " ".join(self.lab.command("n0")).replace(self.lab.machines["n0"].netns,
                                                             f"{self.lab.bridge}-n{{node}}")
        return ["--local-prefix", template]

    def _joiner(self) -> str:
        """The lab name of the next machine that joins: one per process in `extra`."""
        return f"x{len(self.extra)}"

    def _new_machine(self) -> list[str]:
        self.lab.add(self._joiner())
        return self.lab.command(self._joiner())

    def _add_node(self, zone: str, workers: int = 1) -> None:
        name = self._joiner()
        super()._add_node(zone, workers)
        if self._joiner() != name:  # it started (not after the job ended)
            self.machine_of[self.extra[-1].pid] = name

    # -- the machines ---------------------------------------------------------------------
    def _machines(self) -> dict[str, psutil.Process]:
        """lab name -> root process of every machine that runs and is not frozen."""
        roots = {}
        try:
            for p in psutil.Process(self.launcher.pid).children():
                cmd = self._cmdline(p)
                if "--node" in cmd:
                    self.machine_of.setdefault(p.pid, f"n{cmd[cmd.index('--node') + 1]}")
        except psutil.NoSuchProcess:
            pass
        for pid, name in self.machine_of.items():
            if name in self.faulted:
                continue
            try:
                p = psutil.Process(pid)
                if p.is_running() and p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    roots[name] = p
            except psutil.NoSuchProcess:
                continue
        return roots

    def _pick_machine(self) -> tuple[str, psutil.Process] | tuple[None, None]:
        machines = self._machines()
        if not machines:
            return None, None
        name = self.rng.choice(sorted(machines))
        return name, machines[name]

    @staticmethod
    def _tree(root: psutil.Process) -> list[psutil.Process]:
        try:
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _nodes_on(self, root: psutil.Process) -> list[str]:
        return sorted({self._node(p) for p in self._tree(root) if "--node" in self._cmdline(p)})

    # -- faults ---------------------------------------------------------------------------
    def _vanish(self) -> str:
        name, root = self._pick_machine()
        if root is None:
            return "no machine to vanish"
        procs, nodes = self._tree(root), self._nodes_on(root)
        for p in procs:
            self._signal(p, signal.SIGSTOP)
        self.lab.cut(name)
        self.faulted.add(name)  # for good
        self.vanished += procs
        self.later.append((time.monotonic() + 15.0, lambda: self._reap(procs)))
        self.replace.append((time.monotonic() + self.rng.uniform(1.0, 5.0), self._zone_of(root),
                             self.settings.per_host if self._machine(root) else 1))
        return f"{name}: nodes {', '.join(nodes)}"

    def _reap(self, procs: list[psutil.Process]) -> None:
        """The machine is gone: its frozen processes go too (the link stays cut)."""
        for p in procs:
            self._signal(p, signal.SIGKILL)

    def _partition(self) -> str:
        name, root = self._pick_machine()
        if root is None:
            return "no machine to cut"
        seconds = self.rng.uniform(2.0, 12.0)
        self.lab.cut(name)
        self.faulted.add(name)
        self.later.append((time.monotonic() + seconds, lambda: self._restore(name, self.lab.heal)))
        return f"{name} (nodes {', '.join(self._nodes_on(root))}) for {seconds:.1f} s"

    def _etcd_cut(self) -> str:
        name, root = self._pick_machine()
        if root is None:
            return "no machine to cut off"
        seconds = self.rng.uniform(2.0, 10.0)
        members = [f"etcd{i}" for i in range(MEMBERS)]
        for m in members:
            self.lab.block(name, m)
        self.faulted.add(name)
        self.later.append((time.monotonic() + seconds,
                           lambda: self._restore(name, lambda n: [self.lab.unblock(n, m) for m in members])))
        return f"{name} (nodes {', '.join(self._nodes_on(root))}) from etcd for {seconds:.1f} s"

    def _restore(self, name: str, undo) -> None:
        """Undo a fault on machine `name` (heal its link, reconnect it to etcd)."""
        undo(name)
        self.faulted.discard(name)

    def _etcd_member_kill(self) -> str:
        try:
            leader = self.etcd.leader(timeout=3.0)
        except EtcdError:  # no quorum now (two away): any member that runs
            leader = next((i for i, m in enumerate(self.etcd.members) if m.running()), 0)
        self.etcd.kill(leader)
        seconds = self.rng.uniform(1.0, 6.0)
        self.later.append((time.monotonic() + seconds, lambda: self.etcd.restart(leader)))
        return f"leader {self.etcd.members[leader].name}, back after {seconds:.1f} s"

    def _etcd_restart(self) -> str:
        """Two of three members away: no quorum, the job pauses until they return."""
        running = [i for i, m in enumerate(self.etcd.members) if m.running()]
        down = self.rng.sample(running, min(2, len(running)))
        for i in down:
            self.etcd.kill(i)
        seconds = self.rng.uniform(0.5, 3.0)
        self.later.append((time.monotonic() + seconds, lambda: [self.etcd.restart(i) for i in down]))
        return f"members {', '.join(self.etcd.members[i].name for i in down)} down {seconds:.1f} s"

    def _due(self) -> None:
        super()._due()
        now = time.monotonic()
        for item in [x for x in self.later if x[0] <= now]:
            self.later.remove(item)
            try:
                item[1]()
            except Exception as e:  # noqa: BLE001 - the fault's undoing failed: said, and the trial goes on
                self.outcome.faults.append((round(now - self.t0, 2), "undo-failed", f"{type(e).__name__}: {e}"))

    # -- the end --------------------------------------------------------------------------
    def _cleanup(self) -> None:
        for _, action in sorted(self.later, key=lambda x: x[0]):
            try:
                action()  # heals and restarts still due: the job's processes may leave by themselves
            except Exception:  # noqa: BLE001 - cleanup goes on
                pass
        self.later.clear()
        self._reap(self.vanished)  # gone machines are not orphans
        self.seen = {pid: p for pid, p in self.seen.items() if p not in self.vanished}
        super()._cleanup()

    def _stop_etcd(self) -> None:
        self.etcd.stop()

