"""`bamboo-agent`: one per node. It registers the node and its zone in etcd, forms
the first configuration with the other agents through torch elastic's dynamic
rendezvous, starts and watches the node's worker, and takes its turn deciding the
next configuration when the workers ask for one. SIGTERM (or a cloud preemption
notice, with `--notice ec2|gcp`) drains the node: the next configuration leaves it
out, its stages move to their new owners, and the agent exits.

    bamboo-agent --etcd HOST:PORT[,...] --job NAME --zone ZONE [--node ID] [--notice ec2|gcp]
                 [--max-nodes N] [--last-call SECONDS] [--start-timeout SECONDS] [--workers N --host NAME]

With `--workers N` (a machine of N GPUs) it starts N agents, one per worker and
device, that die together and drain together: agents/host.py.

Lifecycle (torch.distributed.elastic's SimpleElasticAgent, steps overridden):
  _rendezvous      register under a lease; the first agents meet in torch elastic's
                   rendezvous (all asked for, or a pipeline's worth and a last call:
                   agents/startup.py) and assignment 0 is written over the live ones;
                   an agent arriving later waits in the standby queue
  _start_workers   start `bamboo.runtime.worker` (in standby it waits, warm, for a stage)
  _monitor_workers the worker's exit status: done, parked (standby), fenced, failed
  _invoke_run      the loop: monitor, reconfigure when asked, drain on request; a node
                   recorded dead (fenced) comes back under a new id, in standby
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, Worker, WorkerSpec, WorkerState

from agents.host import supervise
from agents.membership import Membership
from agents.notices import WATCHERS, watch
from agents.release import Releaser
from agents.rendezvous import rendezvous_handler
from agents.startup import StartFailed, add_flags, meet, rendezvous_options
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.parser import OneLineParser
from bamboo.control.etcd import EtcdError, EtcdLost, die_with_parent
from bamboo.control.exits import FENCED, PARKED, RELEASED, Fenced
from bamboo.control.protocol import (CONFIG, DONE, ERROR, FAILED, LEFT, NOTICES, REGROUP, Notice, Timestamp,
                                     WorkerError)
from bamboo.runtime import WORKER


FENCE_GRACE = 3.0  # seconds a fenced worker has to stop by itself (and log why) before it is killed
MAX_RETURNS = 2    # times a machine comes back under a new id; fenced once more, it leaves (exit 75) as before


class BambooAgent(SimpleElasticAgent):
    def __init__(self, spec: WorkerSpec, membership: Membership, cfg: JobConfig, log_dir: str | None,
                 grow_group: str | None = None):
        super().__init__(spec)
        self.membership, self.cfg, self.log_dir = membership, cfg, log_dir
        self.cluster: Cluster = membership.cluster
        self.proc: subprocess.Popen | None = None
        self.draining = False
        self.exit_code: int | None = None  # the worker's, once it exited
        self._fence_checked = 0.0          # when FAILED(node) was last read
        self.returns = 0                   # times this machine came back under a new id
        self.releaser = Releaser(self.cluster, cfg, membership.hosts)  # the surplus rule's decision of each epoch
        self.released = False              # this node was released: it drains, and its machine leaves
        self.grow_group = grow_group       # "MODULE ARGS": how this node's group grows (run with --desired N)
        self.growing: subprocess.Popen | None = None  # that command, while it runs

    @property
    def node(self) -> int:
        return self.membership.node

    # -- torch elastic lifecycle steps ---------------------------------------------------
    def _rendezvous(self, worker_group) -> None:
        rank, world = meet(worker_group.spec.rdzv_handler, self.membership, self.cfg)  # agents/startup.py
        worker_group.workers = [Worker(local_rank=0, global_rank=self.node, role_rank=rank, world_size=world,
                                       role_world_size=world)]
        worker_group.group_rank, worker_group.group_world_size = rank, world
        self.cluster.wait_for(self.cluster.assignments, timeout=self.cfg.faults.stall_timeout,
                              what="the first assignment")

    def _start_workers(self, worker_group) -> dict[int, int]:
        if self.proc is not None or self.draining or self.membership.job_finished():
            return {}  # a worker runs (in standby it waits, warm, for a stage), or none is wanted
        log = open(os.path.join(self.log_dir, f"worker{self.node}.log"), "a") if self.log_dir else subprocess.DEVNULL
        spec = worker_group.spec
        self.proc = subprocess.Popen([spec.entrypoint, *spec.args], stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)
        return {0: self.proc.pid}

    def _stop_workers(self, worker_group, is_restart: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _monitor_workers(self, worker_group) -> RunResult:
        """A worker that exited is judged by its status (one that crashed, or was
        killed alone, ends this node as before); one that runs on, or none, while
        the node is recorded dead, by the fence."""
        exited = self.proc is not None and self.proc.poll() is not None
        if not exited and self._fenced():
            return self._stop_fenced()
        if not exited:
            return RunResult(state=WorkerState.HEALTHY)
        self.exit_code = code = self.proc.returncode
        if code == FENCED:  # it stopped itself, fenced: the machine comes back
            return self._stop_fenced()
        if code == 0:
            return self._succeeded()
        if code == PARKED:
            return RunResult(state=WorkerState.STOPPED)
        return RunResult(state=WorkerState.FAILED)  # why: self.exit_code

    def _fenced(self) -> bool:
        """Whether this node is recorded dead: its heartbeat found its lease revoked,
        or FAILED(node) is there (read at most twice a second)."""
        if self.membership.fenced_why:
            return True
        now = time.monotonic()
        if now - self._fence_checked < 0.5:
            return False
        self._fence_checked = now
        return self.cluster.get(FAILED(self.node)) is not None

    def _stop_fenced(self) -> RunResult:
        """The node is dead to the job. Its worker stops by itself within a
        heartbeat, saying why in its log; one that does not (frozen, stuck in a
        collective) is killed after FENCE_GRACE."""
        why = self.membership.fenced_why or self.cluster.death_of(self.node)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=FENCE_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        status = "no worker" if self.proc is None else f"its worker exited with status {self.proc.returncode}"
        print(f"bamboo-agent: fenced: {why}; {status}", file=sys.stderr, flush=True)
        self.proc, self.exit_code = None, FENCED
        return RunResult(state=WorkerState.FAILED)

    def _come_back(self, group) -> None:
        """A node recorded dead never returns under its id: this machine (paid for,
        and reachable again) registers as a new node, in standby, holding nothing."""
        old = self.node
        self.returns += 1
        self.membership = self.membership.successor()
        group.spec.args = (*group.spec.args[:-1], str(self.node))  # the worker's --node
        self.exit_code = None
        print(f"bamboo-agent: node {old} stays dead; this machine comes back as node {self.node}, in standby",
              file=sys.stderr, flush=True)
        self._rendezvous(group)

    def _succeeded(self) -> RunResult:
        return RunResult(state=WorkerState.SUCCEEDED, return_values={self.node: 0})

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, is_restart: bool = False,
                  timeout: int = 30) -> None:
        self._stop_workers(self._worker_group)
        self.membership.leave()

    def _invoke_run(self, role: str = "default") -> RunResult:
        group = self._worker_group
        self._rendezvous(group)
        while True:
            try:
                result = self._step(group)
            except Fenced:  # etcd refused this agent's write: the node was recorded dead
                result = self._stop_fenced()
            if result is None:
                continue
            if result.state == WorkerState.FAILED and self.exit_code == FENCED and not self._leaving() \
                    and self.returns < MAX_RETURNS:
                self._come_back(group)
                continue
            return result

    def _step(self, group) -> RunResult | None:
        """One round of the loop: the result that ends the run, or None."""
        self._start_workers(group)
        self.membership.wait(group.spec.monitor_interval)
        looked = self.membership.due()  # something it watches changed, or a second passed
        if looked:
            self.membership.decide(self.cfg)  # the leading agent writes the next configuration
            self.membership.observe_modes(self.cfg)  # --redundancy auto: the mode wanted next
        self._release_if_surplus(looked)
        result = self._monitor_workers(group)
        group.state = result.state
        if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
            return result
        if result.state == WorkerState.STOPPED:  # parked: back to the standby queue
            self.proc = None
            if self.draining:
                return self._succeeded()
        if self.draining:
            self.membership.drain()  # the worker leaves after handing its stages over
            if self.proc is None:
                return self._succeeded()
        if self.proc is None and self.membership.job_finished():
            return self._succeeded()
        return None

    def _release_if_surplus(self, looked: bool = True) -> None:
        """--surplus: once this node is released (agents/release.py), it drains and leaves.
        `looked`: the agent looks at etcd in this round (Membership.due)."""
        decision = self.releaser.round(self.membership.live, looked, self.membership.leading)
        grown = self.releaser.take_growth()
        if self.growing is not None and self.growing.poll() is not None:  # reaped; it said why it failed, if it did
            self.growing = None
        if grown is not None and self.grow_group:  # on a cloud: the boot script's group module
            print(f"bamboo-agent: the job asks for {grown} nodes: growing the group", file=sys.stderr, flush=True)
            self.growing = subprocess.Popen([sys.executable, "-m", *shlex.split(self.grow_group), "--desired",
                                             str(grown)], stdin=subprocess.DEVNULL)
        if decision is None or self.node not in decision.nodes or self.draining:
            return
        newest = self.cluster.latest_assignment()
        if newest.epoch != self.releaser.decided or self.node in newest.members:
            return  # a newer epoch came (and may place this node): its own decision says
        self.draining = self.released = True
        print(f"bamboo-agent: node {self.node} released: in no pipeline, beyond the {decision.standby} standby "
              f"--surplus {self.cfg.cluster.surplus} keeps ({decision.desired} nodes asked for)", file=sys.stderr,
              flush=True)

    def _leaving(self) -> bool:
        """Whether this machine leaves rather than coming back: it drains, or the job ended."""
        return self.draining or self.membership.job_finished()


def wait_for_iteration(cluster: Cluster, iteration: int, cfg: JobConfig) -> bool:
    """Block until iteration `iteration` is done: its boundary's record, woken by a
    watch on those; False if the job finished first. A node booted ahead this way
    joins when asked, whatever its start-up takes."""
    agreed = cluster.changes(REGROUP())
    try:
        while True:
            agreed.take()  # lowered before the read: a record after it wakes the wait
            if cluster.children(DONE(cfg.schedule.iterations - 1)):
                return False
            if cluster.children(REGROUP(iteration)):
                return True
            agreed.wait(1.0)
    finally:
        agreed.close()  # the job's later boundaries need not wake this agent


def left(cluster: Cluster, node: int) -> None:
    """LEFT(node): this node's paid time ends now (the dashboard's ledger). Best
    effort: a node recorded dead, or an etcd gone, has its end from its death."""
    try:
        cluster.put(LEFT(node), Timestamp(time.time()))
    except (EtcdError, EtcdLost, Fenced):
        pass


def missing_gpus(expected: int) -> str | None:
    """Why this machine cannot run its workers on the GPUs it should have (None: it can)."""
    import torch
    found = torch.cuda.device_count()
    if found >= expected:
        return None
    return (f"no GPU: this machine should have {expected} and torch {torch.__version__} sees {found} "
            f"(CUDA {torch.version.cuda or 'not built in'}); check the image's NVIDIA driver (nvidia-smi)")


def _check_args(ap, args) -> None:
    """Values no agent could use, refused (argparse's error) before etcd is asked anything."""
    for flag, value, least in (("--min-nodes", args.min_nodes, 1), ("--max-nodes", args.max_nodes, 1),
                               ("--node", args.node, 0), ("--register-after", args.register_after, 0),
                               ("--expect-gpus", args.expect_gpus, 0)):
        if value is not None and value < least:
            ap.error(f"{flag} must be at least {least} (got {value})")
    for flag, value in (("--job", args.job), ("--zone", args.zone)):
        if not value.strip():
            ap.error(f"{flag} must not be empty")


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="bamboo-agent", description=__doc__.splitlines()[0],
                allow_abbrev=False)  # agents/host.py strips its flags by their full names
    ap.add_argument("--etcd", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="the job's etcd")
    ap.add_argument("--job", required=True, help="the job's name, as its launcher gave it")
    ap.add_argument("--zone", required=True, help="availability zone of this node")
    ap.add_argument("--node", type=int, help="node id (default: the next free one)")
    add_flags(ap)  # --min-nodes, --max-nodes, --last-call, --start-timeout: the first configuration's wait
    ap.add_argument("--log-dir", help="write the worker's output here")
    ap.add_argument("--notice", choices=sorted(WATCHERS), help="watch this cloud's preemption notices")
    ap.add_argument("--metadata-url", help="the metadata service to watch (default: the cloud's own)")
    ap.add_argument("--expect-gpus", type=int, default=0, metavar="N",
                    help="this machine should have N GPUs: with fewer seen by torch, the node records one error "
                         "line in the job's etcd and exits with status 1 (a cloud boot script's check)")
    ap.add_argument("--register-after", type=int, metavar="ITER",
                    help="start now, register once iteration ITER is done (the launcher's --join)")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="this machine's workers: N agents, each a node with its own device (agents/host.py)")
    ap.add_argument("--host", help="the machine's name, shared by its nodes (default with --workers: the hostname)")
    ap.add_argument("--grow-group", metavar="'MODULE ARGS'",
                    help="with --surplus: when a decision of this agent asks for more nodes than the last, run "
                         "python -m MODULE ARGS --desired N (a cloud's boot script gives its group's module)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    if args.workers != 1:  # a machine of several workers (--workers 0 is refused there)
        return supervise(ap, sys.argv[1:] if argv is None else argv, args)
    try:
        cluster = Cluster(args.etcd, args.job, wait=True)
        cfg = cluster.wait_for(lambda: cluster.get(CONFIG()), timeout=60, what=f"job {args.job!r} in etcd")
        if args.register_after is not None and not wait_for_iteration(cluster, args.register_after, cfg):
            return 0  # the job finished first: nothing to join
    except (EtcdError, EtcdLost, TimeoutError) as e:
        print(f"bamboo-agent: error: {e}", file=sys.stderr)
        return 1
    try:
        membership = Membership(cluster, args.zone, args.node, cfg, host=args.host)
    except ValueError as e:
        print(f"bamboo-agent: error: {e}", file=sys.stderr)
        return 1
    if (missing := missing_gpus(args.expect_gpus)) is not None:  # the job hears why this node never starts
        try:
            cluster.put(ERROR(membership.node), WorkerError(missing))
        except (EtcdError, EtcdLost, Fenced):
            pass  # the line below still says it
        membership.leave()  # no longer counted live: no stage is given to it
        print(f"bamboo-agent: error: {missing}", file=sys.stderr)
        return 1
    handler = rendezvous_handler(args.etcd, args.job, local_addr=socket.gethostname(), **rendezvous_options(args, cfg))
    spec = WorkerSpec(role="bamboo", local_world_size=1, rdzv_handler=handler, entrypoint=sys.executable,
                      args=("-m", WORKER, "--etcd", args.etcd, "--job", args.job,
                            "--node", str(membership.node)), monitor_interval=0.05)
    agent = BambooAgent(spec, membership, cfg, args.log_dir, args.grow_group)

    def drain(signum, frame):
        agent.draining = True
    signal.signal(signal.SIGTERM, drain)

    def noticed(notice: dict) -> None:  # leave now, handing the stages over, before the kill
        agent.draining = True
        try:  # under the node's id of now (a machine back from a partition has a new one)
            cluster.put(NOTICES(agent.node), Notice(notice["source"], time.time(), notice.get("action")))
        except (Fenced, EtcdLost) as e:
            print(f"bamboo-agent: the notice could not be recorded ({e}); draining all the same", file=sys.stderr)
    if args.notice:
        watch(args.notice, noticed, args.metadata_url, interval=0.2)
    try:
        result = agent.run()
        handler.shutdown()
    except (EtcdError, EtcdLost, TimeoutError, StartFailed) as e:  # one line, not a traceback
        print(f"bamboo-agent: error: {e}", file=sys.stderr)
        return 1
    finally:
        left(cluster, agent.node)
    if result is None or result.state == WorkerState.SUCCEEDED:
        return RELEASED if agent.released else 0
    return FENCED if agent.exit_code in (FENCED, -signal.SIGKILL) else 1


def run() -> None:
    """`bamboo-agent` and `python -m agents.agent`: main(), then exit at once, without
    the interpreter's teardown (gRPC's and torch's: 2 to 7 s on a loaded machine). The
    node's paid time ends when its process does, and its LEFT stamp is the ledger's
    end of it; everything is written and flushed by then."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
