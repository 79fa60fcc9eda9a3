"""One worker process: node `--node` of the job, running the stage its assignment
gives it (without agents: stage node % P of pipeline node // P) and keeping the
replica of the next stage. A node in standby waits, started, for a stage.

    python -m bamboo.runtime.worker --etcd HOST:PORT[,HOST:PORT...] --job NAME --node N

Its lifecycle, in the manner of torch elastic's agent, is the list of public
methods of `Worker`, in order: join (wait for a stage), enter an epoch, run an
iteration, evaluate it (the validation loss, when due, bamboo/runtime/evaluator.py),
end it at the boundary (bamboo/runtime/boundary.py), reconfigure when the agents wrote
a new epoch (layers move, bamboo/state/handover.py; the moves between epochs are
`EpochMoves`, bamboo/state/epochs.py), leave. Fencing,
parking and release are exceptions (bamboo/control/exits.py) that reach `main`, which
maps them to exit statuses.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import resource
import signal
import sys
import time
from collections import Counter

import torch

from schedules.layout import Layout
from schedules.options import Redundancy, ReplicaSync

from bamboo.control.assignment import Assignment, Restore
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig, Transport
from bamboo.control.exits import FENCED, WorkerExit
from bamboo.control.liveness import hang_deadline
from bamboo.control.protocol import (ABORT, ABORTED, ASSIGNMENT, COMPLETED, CONFIG, DRAIN, ERROR, FAILED, LOAN, REGROUP,
                                     SCALE, START, LossScale, Mark, Regroup, Report, Start, Timestamp, WorkerError,
                                     world_store)
from bamboo.control.store import EtcdStore, RendezvousAborted
from bamboo.data.corpus import corpus_of
from bamboo.model.api import ModelSource
from bamboo.model.builtin import fp16_allowed
from bamboo.runtime import calibration
from bamboo.runtime.boundary import Boundary
from bamboo.state.checkpoint import Checkpoints
from bamboo.state.copies import MemoryCopies
from bamboo.state.epochs import EPOCH_POLL, EpochMoves
from bamboo.runtime.evaluator import Evaluator
from bamboo.runtime.executor import Executor
from bamboo.runtime.failover import Aborted, Failover
from bamboo.runtime.watch import Watches
from bamboo.runtime.lending import Loans
from bamboo.state.holdings import Holdings
from bamboo.runtime.reduce import Reducer
from bamboo.transport import devices
from bamboo.transport.channels import for_worker, nccl_groups
from bamboo.transport.comm import Comm
from bamboo.transport.groups import lease_check, open_group, store_at
from bamboo.transport.staging import Stager


class Worker(EpochMoves):
    def __init__(self, cluster: Cluster, cfg: JobConfig, node: int):
        self.cluster, self.cfg, self.node = cluster, cfg, node
        self.device = devices.claim(devices.local_rank(), cfg.devices.names, cfg.devices.share_gpu)
        self.transport = devices.transport(cfg.devices.transport, self.device, cfg.devices.share_gpu)
        self.stager = Stager(self.device)  # pinned host buffers and a side stream: messages, swaps
        self.source = ModelSource.of(cfg.model)
        self.corpus = corpus_of(cfg, self.source.seq)
        self.holdings = Holdings(self.source, cfg, self.device)
        self.checkpoints = Checkpoints(cfg, node, self.source.count)
        # checkpoints kept in memory too
        self.copies = MemoryCopies(cluster, node, cfg.faults.hang_timeout, self.holdings.blob_bound)
        # Watches the failover and the boundary read instead of polling etcd (docs/HOTPATH.md)
        self.failures = cluster.changes(FAILED(), ABORT(), LOAN())  # a loan asked wakes a lender's next look
        self.finishes = cluster.changes(FAILED(), ABORT())
        self.epochs = cluster.changes(ASSIGNMENT(), DRAIN())  # what ends a wait for a stage or the next epoch
        self.boundary = Boundary(cluster, node, cfg.cluster.elastic, self.checkpoints, cfg.faults.straggler_factor,
                                 cfg.faults.straggler_slack, auto=cfg.agents_choose,
                                 changes=cluster.changes(FAILED(), ABORT(), REGROUP()))
        self.assignment: Assignment | None = None  # the epoch this node runs in
        self.failed: tuple[int, ...] = ()          # nodes dead job-wide, as the last boundary agreed
        self.pipeline = self.me = 0                # where this node runs in the epoch
        self.mbs = range(0)                        # this pipeline's share of the global microbatches
        self.epoch_iterations = 0                  # iterations begun in this epoch (calibration.CALIBRATION)
        self.op_times = calibration.OpTimes()      # op times of this epoch's calibration iterations (run_iteration)
        self.failover: Failover | None = None
        self.executor: Executor | None = None
        self.evaluator: Evaluator | None = None
        self.comm: Comm | None = None
        self._store = None                         # the world group's store (the group keeps using it)
        self.iteration_seconds: list[float] = []   # the hang deadline follows their running median
        self.loss_scale: LossScale | None = None   # fp16: the scale of the iteration being run
        self.base_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before any layer is built
        self.sent: Counter = Counter()  # payload bytes this node sent since it started, by kind (Comm, Reducer)
        if cfg.recipe.loss_scaling and not fp16_allowed(self.device):
            raise ValueError("--precision fp16 needs CUDA, and this node has none")

    def run(self) -> None:
        it = self.join()
        while it < self.cfg.schedule.iterations:
            try:
                self.run_iteration(it)
                self.evaluate(it)
                agreed = self.end_iteration(it)
            except Aborted:
                it = self.reconfigure(it, aborted=True)
                continue
            if agreed.checkpoint:
                self.checkpoint(it)
            if agreed.reconfigure and it + 1 < self.cfg.schedule.iterations:
                it = self.reconfigure(it)
                continue
            it += 1
        self.leave()

    # -- lifecycle -----------------------------------------------------------------------
    def join(self) -> int:
        """Wait for a stage, enter the first epoch that gives one, and return the
        iteration this node starts with: a new job's first (or --resume's
        checkpoint's), or a running job's next epoch, joined by a handover."""
        assignment = self.cluster.wait_for(self._assigned, timeout=24 * 3600, what="a stage", poll=EPOCH_POLL,
                                           changes=self.epochs)
        if assignment.epoch > 0 or assignment.restore != Restore.PEERS:
            return self._move_to(assignment)  # joining a running job, or restarting from a checkpoint
        self.failed = assignment.gone
        start, received = assignment.start, {}
        if self.cfg.checkpoints.resume:  # with agents, the checkpoint they started the job from
            chosen = self.cfg.cluster.elastic and start > 0
            start, blobs = (start, self.checkpoints.taken_before(start)) if chosen else self.checkpoints.newest()
            received = {i: blobs[i] for i in self.holdings.needs(assignment, self.node)}
            self._restore_loss_scale(start)
        self.enter(assignment, received)
        self.cluster.create(START(), Start(start))
        try:
            self.comm = self._world(world_store(0), start, starting=assignment.members)
        except (RendezvousAborted, RuntimeError) as e:  # a node died before the first iteration
            if not self.cfg.cluster.elastic:
                raise
            return self._move_to(self._abandon(assignment, e))
        return start

    def enter(self, assignment: Assignment, received: dict[int, bytes]) -> None:
        """Take this node's place in `assignment`: build its stages from the layers
        it kept and the ones it `received`, and the failover, reducer and executor
        that run them."""
        self.assignment = assignment
        self.epoch_iterations, self.op_times = 0, calibration.OpTimes()
        self.pipeline, self.me = assignment.slot(self.node)
        self.holdings.build(assignment, self.node, received)
        nodes = assignment.pipelines[self.pipeline]
        # by speed: short pipelines run fewer
        self.mbs = assignment.microbatches(self.cfg.schedule.microbatches, self.pipeline)
        options = self.cfg.options(self.holdings.mode(assignment), self.cfg.schedule.epoch_sync(assignment))
        stages = self.holdings.stages()
        recipe = self.cfg.recipe
        loans = Loans(self.cluster, assignment, self.node, stages.modules, options.redundancy != Redundancy.OFF,
                      copies=bool(recipe.grad_clip) or recipe.loss_scaling)
        self.failover = Failover(self.cluster, nodes, self.pipeline, self.me, options, self.cfg,
                                 Watches(self.failures, self.finishes), report_of=lambda: self._report(digests=False))
        self.failover.loans = loans
        if self.executor is not None:
            self.executor.reducer.close()  # the last epoch's groups (NCCL: their GPU memory)
        groups = nccl_groups(self.cfg.faults.hang_timeout) if self.transport == Transport.NCCL else None  # the reduce's
        reducer = Reducer(self.cluster, assignment, self.node, self.cfg.faults.failure_timeout, self.failover,
                          self.cfg.faults.hang_timeout, groups, sent=self.sent)
        # With agents, each step can be undone, so that an iteration no pipeline can
        # finish is redone from the copies the survivors hold.
        self.executor = Executor(self.cfg, nodes, self.me, stages, self.corpus, reducer,
                                 self.cluster, self.stager)
        self.executor.late = self.failover.sync is ReplicaSync.NEXT  # the epoch's sync: in the next iteration
        self.evaluator = Evaluator(self.cfg, nodes, self.me, self.holdings.modules, self.corpus, self.device,
                                   self.cluster)

    def run_iteration(self, it: int) -> None:
        """This node's stream of iteration `it`, recovering inside it from one
        death per pipeline (bamboo/runtime/failover.py)."""
        began = time.monotonic()
        kills = self._kills(it)
        self.boundary.arm()
        self.failover.begin(it, len(self.mbs), self.local_failed(), self.comm, kills,
                            owed=self.epoch_iterations > 0,  # --replica-sync next: the syncs of it - 1
                            final=self._promotes(it))
        self.epoch_iterations += 1
        stream = self.failover.now.streams[self.me]  # the failover keeps every node's stream: one compile
        self.loss_scale = self._loss_scale_of(it)
        timed = self._timed(self.epoch_iterations - 1)
        self.executor.ahead_next = None if self.cfg.evaluates(it) else self._ahead_of(it + 1)  # not beside an eval
        self.executor.run(it, stream, self.mbs, self.comm, self.failover,
                          self.loss_scale.scale if self.loss_scale else 1.0, self.op_times if timed else None)
        self.iteration_seconds.append(time.monotonic() - began)
        self.cluster.hang_deadline(hang_deadline(self.iteration_seconds, self.cfg.faults.hang_timeout))

    def evaluate(self, it: int) -> None:
        """After iteration `it`'s step, when due: this pipeline's share of the
        validation microbatches, forward only on the pipeline as it stands (a node
        merged in by a failover included). A death cuts it short: the boundary
        then handles the death as one between iterations."""
        if not self.cfg.evaluates(it):
            return
        mbs = self.assignment.microbatches(self.cfg.data.eval_batches, self.pipeline)
        if mbs:
            self.cluster.hang_deadline(self.cfg.faults.hang_timeout)  # not an iteration's pace
            self.executor.settle_replicas()  # a merged pipeline evaluates on a replica
            self.evaluator.run(it, mbs, self.comm, self.failover)
            self.cluster.hang_deadline(hang_deadline(self.iteration_seconds, self.cfg.faults.hang_timeout))

    def end_iteration(self, it: int) -> Regroup:
        """Report, and agree with every live node on what the next iteration runs with;
        with --compute-ahead, stage 0's owner runs the next iteration's first forwards
        meanwhile (begun as its stream ended, or after the evaluation)."""
        if (ahead := self._ahead_of(it + 1)) is not None:
            self.executor.start_ahead(ahead, self.failover)
        if self.loss_scale and self.executor.overflow is not None:  # every node decided alike: first wins
            self.cluster.create(SCALE(it), dataclasses.replace(self.loss_scale, overflow=self.executor.overflow))
        self.boundary.report(it, self._report(), self.failover.now.completed if self._promotes(it) else None,
                             reported=self.failover.reported)
        self.failover.events = []
        agreed = self.boundary.agree(it, self.assignment, self.failover, self.failed, self._regroup(it),
                                     idle=self.executor.settle_replicas)  # owed steps fit in the wait
        self.failed = agreed.failed
        cost = calibration.cost_model(agreed.costs, self.pipeline, self.failover.P)
        if cost is not None:
            self.failover.cost = cost  # FRC placed by measured times from the next iteration on
            print(f"bamboo.runtime.worker: node {self.node}: from iteration {it + 1} "
                  + calibration.describe(cost, len(self.mbs), self.local_failed(), self.failover.options, self.me),
                  flush=True)
        return agreed

    def checkpoint(self, it: int) -> None:
        """After iteration `it`, pipeline 0's owners snapshot their layers now and
        write them in the background (the next iteration does not wait); they keep
        the bytes, and each stage's go to one more node's memory too
        (bamboo/state/copies.py: every node of the epoch takes part or forgets its copies)."""
        self.cluster.hang_deadline(self.cfg.faults.hang_timeout)  # waits for the last write: not an iteration's pace
        blobs = scale = None
        if self.pipeline == 0:
            self.executor.settle_replicas()  # a stage owned since this boundary may owe its step
            blobs = self.holdings.snapshot(self._owned())
            scale = self.cluster.get(SCALE(it)) if self.cfg.recipe.loss_scaling else None
            self.checkpoints.write(it + 1, self.assignment.epoch, blobs, scale)
        # without agents, nobody rolls back from copies in memory
        if self.cfg.checkpoints.memory_copies and self.cfg.cluster.elastic:
            self.copies.take(it + 1, self.assignment, self.failed, blobs,
                             lambda stage: self.holdings.layers_of(self.assignment.depth, [stage]), scale,
                             lambda members: self._lease_check(members, it + 1))

    def reconfigure(self, it: int, aborted: bool = False) -> int:
        """Move to the agents' next configuration after iteration `it` (or, when `it`
        was abandoned everywhere, after undoing its steps); return the iteration it
        starts from: the next one, `it` again, or a checkpoint's when a stage was lost
        on every node."""
        self.executor.drop_ahead()  # its modules may be rolled back, moved or replaced
        if aborted:
            self.comm.close()  # NCCL work of the abandoned iteration would never end
            self.executor.reducer.close()
            self.executor.rollback()
            self.checkpoints.wait()  # a checkpoint being written is complete before the agents pick one
            self.cluster.put(ABORTED(it, self.node), Mark())
        return self._move_to(self._next_epoch(self.assignment.epoch))

    def leave(self) -> None:
        """The job's last iteration is agreed: save what is asked for, say so (once
        every node has, a cloud job stops what it pays for: cloud/node_exit.py), and go."""
        self.executor.drop_ahead()
        if self.executor.ahead_taken:
            print(f"bamboo.runtime.worker: node {self.node}: {self.executor.ahead_taken} iterations began with "
                  "their first forwards run while the boundary agreed", flush=True)
        self.executor.settle_replicas()  # a stage taken over at the last boundary is saved stepped
        self.checkpoints.wait()
        if self.cfg.checkpoints.save_dir and self.pipeline == 0:
            self.holdings.save(self._owned(), self.cfg.checkpoints.save_dir)
        self.cluster.create(COMPLETED(self.node), Timestamp(time.time()))

    # -- the steps' parts ----------------------------------------------------------------
    def _loss_scale_of(self, it: int) -> LossScale | None:
        """fp16: the scale iteration `it` runs with, following the record every node
        agreed on for the iteration before (written at its boundary, or brought
        back from a checkpoint by a restart)."""
        if not self.cfg.recipe.loss_scaling:
            return None
        if it == 0:
            return LossScale(self.cfg.recipe.initial_loss_scale)
        before = self.cluster.get(SCALE(it - 1))
        if before is None:
            raise RuntimeError(f"no loss scale record of iteration {it - 1} to start iteration {it} from")
        return before.following(self.cfg.recipe.loss_scale_window, self.cfg.recipe.min_loss_scale)

    def _report(self, digests: bool = True) -> Report:
        """This node's report as it stands (its events stay until the boundary has them)."""
        return Report(rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, base_rss_mb=self.base_rss_mb,
                      sent_bytes=dict(self.sent), time=time.time(),
                      epoch=self.assignment.epoch, events=[e.to_dict() for e in self.failover.events],
                      busy=self.executor.busy, op_ms=self._op_ms(),
                      digests=self.holdings.digests() if digests and self.cfg.testing.check_replicas else None,
                      cuda_mb=torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda"
                      else 0.0)

    def _promotes(self, it: int) -> bool:
        """Whether the reports in the finished marks are final for iteration `it`:
        nothing between the stream and the report changes them (no evaluation, no
        loss scale record to come first, no replica digests to take)."""
        return not (self.cfg.evaluates(it) or self.cfg.recipe.loss_scaling or self.cfg.testing.check_replicas)

    def _kills(self, it: int) -> tuple[tuple[int, int], ...]:
        """Iteration `it`'s --preempt kills in its training stream: (node, instruction)."""
        preempts = self.cfg.testing.preempt
        return tuple((p.node, p.instruction) for p in preempts if p.iteration == it and p.phase == "train")

    def _timed(self, index: int) -> bool:
        """Whether the epoch's iteration `index` (from 0) is one of eager's timed
        calibration iterations (bamboo/runtime/calibration.py)."""
        return self.failover.redundancy == Redundancy.EAGER and index in calibration.CALIBRATION

    def _ahead_of(self, it: int) -> int | None:
        """--compute-ahead: `it`, if its first forwards may run ahead (bamboo/runtime/ahead.py):
        not past the job's end, nor into a timed calibration iteration, nor with a
        --preempt of this node in it (counted from its stream's start); else None."""
        last = it >= self.cfg.schedule.iterations
        if not self.cfg.testing.compute_ahead or last or self._timed(self.epoch_iterations):
            return None
        return None if any(node == self.node for node, _ in self._kills(it)) else it

    def _op_ms(self) -> dict | None:
        """Eager, at the last of the epoch's calibration iterations: the median time
        of each op this node ran in them (none on CUDA: nothing was timed)."""
        if self.failover.redundancy != Redundancy.EAGER or self.epoch_iterations != calibration.CALIBRATION.stop:
            return None
        return self.op_times.medians_ms() or None

    def _regroup(self, it: int):
        """How the boundary rebuilds the world without the newly dead."""
        def regroup(failed: tuple[int, ...], attempt: int) -> None:
            self.failed = failed
            self.comm = self._world(world_store(self.assignment.epoch, it, attempt), it)
        return regroup

    def _lease_check(self, members, iteration: int, starting=()):
        """Gives a rendezvous up once a member lost its lease. A node in `starting`
        may not have registered yet: it counts as alive while its agent is, or,
        without agents, always (the launcher watches it)."""
        if not self.cfg.cluster.elastic:
            members, starting = [n for n in members if n not in set(starting)], ()
        return lease_check(self.cluster, members, iteration, self.node, starting)

    def _world(self, store_key: str, iteration: int, starting=()) -> Comm:
        """The world process group of the live nodes, meeting at `store_key`."""
        members = [n for n in self.assignment.members if n not in self.failed]
        lease_check = self._lease_check(members, iteration, starting)
        pg, rank_of, self._store = open_group(self.cluster, store_key, members, self.node, lease_check,
                                              self.cfg.faults.hang_timeout)
        if self.comm is not None:
            self.comm.close()  # the old world's channels (NCCL: their GPU memory)

        def store_for(src: int, dst: int, kind: str) -> EtcdStore:  # gives up when an end is gone
            return store_at(self.cluster, f"{store_key}/channel/{src}-{dst}/{kind}",
                            self._lease_check([src, dst], iteration, starting), self.cfg.faults.hang_timeout)
        channels = for_worker(self.transport, store_for, self.node, self.cfg.faults.hang_timeout)
        return Comm(pg, rank_of, self.device, stager=self.stager, channels=channels, sent=self.sent)

    def local_failed(self) -> tuple[int, ...]:
        return self.assignment.local_failed(self.pipeline, self.failed)

    def _owned(self) -> tuple[int, ...]:
        return Layout(self.assignment.depth, frozenset(self.local_failed())).owned(self.me)


def fence(reason: str) -> None:
    """Stop at once, saying why: this node's peers count it dead."""
    print(f"bamboo.runtime.worker: fenced: {reason}", file=sys.stderr, flush=True)
    os._exit(FENCED)


GIL_SWITCH_SECONDS = 0.0005


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bamboo.runtime.worker")
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--node", type=int, required=True)
    args = ap.parse_args(argv)
    faulthandler.enable(all_threads=True)  # a crash in native code leaves every thread's stack in the log
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: the same, on demand
    torch.set_num_threads(1)
    # Messages leave and arrive on threads (bamboo/transport/comm.py) that need the GIL while
    # the main thread computes: hand it over after 0.5 ms, not Python's 5 ms.
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    cluster = Cluster(args.etcd, args.job, wait=True)
    cfg = cluster.get(CONFIG())
    try:
        cluster.register(args.node, cfg, on_fenced=fence)  # refused (Fenced) for a node recorded dead already
        Worker(cluster, cfg, args.node).run()
        status = 0
    except WorkerExit as e:
        status = e.status
        print(f"bamboo.runtime.worker: {type(e).__name__.lower()}: {e}", file=sys.stderr)
    except Exception as e:  # one line in etcd for the launcher, the traceback on stderr
        if args.node not in cluster.failed():
            try:
                cluster.put(ERROR(args.node), WorkerError(f"{type(e).__name__}: {e}"))
            except WorkerExit:  # recorded dead meanwhile: etcd refused the line (Fenced)
                pass
            else:
                raise
        print(f"bamboo.runtime.worker: fenced: node {args.node} was declared dead, then hit "
              f"{type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        status = FENCED  # woke up after being declared dead: whatever broke, step aside
    # Process groups of an abandoned iteration may still hold a pending collective:
    # leave without running their destructors (which would abort the process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
