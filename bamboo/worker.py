"""One worker process: node `--node` of the job, running the stage its assignment
gives it (without agents: stage node % P of pipeline node // P) and keeping the
replica of the next stage. A node in standby waits, started, for a stage.

    python -m bamboo.worker --etcd HOST:PORT --job NAME --node N

Between iterations every worker writes its report to etcd and waits for every
other live node's; the first to get there fixes the failed set the next iteration
runs with and whether the agents must reconfigure first. Without a change the world
process group is rebuilt without the dead under a new prefix; with one, layers move
to their new owners (bamboo/handover.py) and every group is rebuilt for the new
epoch. An iteration no pipeline can finish is undone everywhere and run again. A
worker its peers have declared dead stops (exit status FENCED); one left without a
stage leaves (PARKED).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta

import torch

from schedules.layout import Layout

from bamboo.cluster import Cluster
from bamboo.comm import Comm, new_group
from bamboo import handover
from bamboo.assignment import Assignment, latest_assignment, previous_assignment
from bamboo.config import FENCED, PARKED, JobConfig
from bamboo.data import ByteCorpus, split_microbatches
from bamboo.executor import Executor
from bamboo.failover import Aborted, Failover
from bamboo.api import ModelSource
from bamboo.checkpoint import CheckpointError, Writer, latest, load, restore, snapshot, storage_for
from bamboo.models import Stage
from bamboo.partition import partition
from bamboo.reduce import Reducer
from bamboo.store import EtcdStore


def digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
        for v in optimizer.state.get(p, {}).values():
            h.update(v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def save_layer(module: torch.nn.Module, path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    os.close(fd)
    torch.save(module.state_dict(), tmp)
    os.replace(tmp, path)


class Worker:
    def __init__(self, cluster: Cluster, cfg: JobConfig, node: int):
        self.cluster, self.cfg, self.node = cluster, cfg, node
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.source = ModelSource(cfg.model, cfg.seed, cfg.torch_dtype, cfg.seq)
        self.corpus = ByteCorpus(list(cfg.data_files), seq=self.source.seq, batch=cfg.batch, seed=cfg.seed)
        self.layers: dict[int, torch.nn.Module] = {}   # layer index -> module, every layer held
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.writer = storage = None
        self.began = time.time()
        if cfg.checkpoint:
            storage = storage_for(cfg.checkpoint)
            self.writer = Writer(storage, node)
        assignment = cluster.wait_for(self._assigned, timeout=24 * 3600, what="a stage", poll=0.05)
        self.failed_global: list[int] = sorted(assignment.gone)
        if assignment.epoch == 0 and assignment.restore == "peers":
            self.start, received = assignment.start, {}
            if cfg.resume:
                self.start, blobs = self._restore(storage)
                received = {i: blobs[i] for i in self._needs(assignment, node)}
            self._enter(assignment, received)
            cluster.create(self.start, "start")
        else:  # joining a running job, or everyone restarting from a checkpoint
            self.start = assignment.start
            self._reconfigure(assignment, previous_assignment(cluster, assignment.epoch))
        self.comm = self._world(f"e{assignment.epoch}", self.start, starting=assignment.members)

    def _assigned(self) -> Assignment | None:
        """The newest assignment once it gives this node a stage. Until then the
        node is in standby, started and warm; it leaves when training is over."""
        assignment = latest_assignment(self.cluster)
        if self.node in assignment.members:
            return assignment
        if self.cluster.children("done", self.cfg.iterations - 1):
            os._exit(0)
        if self.cluster.get("drain", self.node) is not None:
            os._exit(PARKED)  # asked to leave before it had a stage
        return None

    # -- which stages this node runs -----------------------------------------------------
    def _needs(self, assignment: Assignment, node: int) -> set[int]:
        """Layer indexes `node` holds in `assignment`: its stage and, with
        redundancy, the next stage's."""
        P = assignment.depth
        _, s = assignment.slot(node)
        stages = {s} | ({(s + 1) % P} if self.cfg.redundancy == "eager" else set())
        ranges = partition(self.source.costs(), P)
        return {i for st in stages for i in ranges[st]}

    def _enter(self, assignment: Assignment, received: dict[int, bytes]) -> None:
        """Build this node's stages for `assignment` from the layers it kept and the
        ones it received, and the executor, failover and reducer that run them."""
        self.assignment = assignment
        self.P = assignment.depth
        self.pipeline, self.me = assignment.slot(self.node)
        nodes = assignment.pipelines[self.pipeline]
        self.ranges = partition(self.source.costs(), self.P)
        held = {self.me} | ({(self.me + 1) % self.P} if self.cfg.redundancy == "eager" else set())
        old_state = {p: st for opt in self.optimizers.values() for p, st in opt.state.items()}
        layers = {i: self.layers[i] if i in self.layers else self.source.layer(i).to(self.device)
                  for s in held for i in self.ranges[s]}
        self.modules = {s: Stage([layers[i] for i in self.ranges[s]], self.source.loss if s == self.P - 1 else None,
                                 self.ranges[s].start) for s in sorted(held)}
        self.optimizers = {s: torch.optim.AdamW(m.parameters(), lr=self.cfg.lr) for s, m in self.modules.items()}
        self.layers = layers
        for s, opt in self.optimizers.items():
            for p in self.modules[s].parameters():
                if p in old_state:
                    opt.state[p] = old_state[p]
        for i, blob in received.items():
            restore(blob, layers[i], self.optimizers[self._stage_of(i)])
        self.mbs = split_microbatches(self.cfg.microbatches, len(assignment.pipelines))[self.pipeline]
        self.failover = Failover(self.cluster, nodes, self.pipeline, self.me, self.cfg.redundancy,
                                 self.cfg.failure_timeout, self.cfg.elastic)
        reducer = Reducer(self.cluster, assignment, self.node, self.cfg.failure_timeout, self.failover)
        # With agents, each step can be undone, so that an iteration no pipeline can
        # finish is redone from the copies the survivors hold.
        self.executor = Executor(self.cfg, nodes, self.me, self.modules, self.optimizers, self.corpus,
                                 self.device, reducer, self.cluster, undo=self.cfg.elastic)

    def _stage_of(self, layer: int) -> int:
        return next(s for s in self.modules if layer in self.ranges[s])

    def _reconfigure(self, new: Assignment, old: Assignment | None) -> None:
        """Move layers to the nodes that need them from the nodes that hold them,
        then take this node's place in `new` (or leave, if it has none)."""
        live_old = {n: stages for n, stages in old.holders(new.failed, self.cfg.redundancy).items()
                    if n not in new.gone} if old and new.restore == "peers" else {}
        old_ranges = partition(self.source.costs(), old.depth) if live_old else []
        have = {n: {i for s in stages for i in old_ranges[s]} for n, stages in live_old.items()}
        need = {n: self._needs(new, n) for n in new.members}
        if new.restore == "checkpoint":
            received = self._from_checkpoint(need[self.node], new.start) if self.node in need else {}
        else:
            members = sorted(set(need) | set(have))
            store = EtcdStore(self.cluster.client, self.cluster.key("pg", "handover", new.epoch),
                              timedelta(hours=24), lambda: self._silent(members, new.start, set(need) - set(have)))
            pg, rank_of = new_group(store, members, self.node)
            received = handover.execute(pg, rank_of, self.node, handover.plan(have, need), self.layers,
                                        lambda i: self.optimizers[self._stage_of(i)])
            pg.barrier().wait()  # every layer arrived before a sender may leave
        if self.node not in new.members:
            if self.writer:
                self.writer.wait()
            os._exit(PARKED)  # nothing to run in this epoch: back to standby
        self._enter(new, received)

    def _from_checkpoint(self, layers: set[int], iteration: int) -> dict[int, bytes]:
        """The layers of the checkpoint the agents chose (taken before `iteration`)."""
        found = load(storage_for(self.cfg.checkpoint), iteration, self.source.count) if self.cfg.checkpoint else None
        if found is None:
            raise CheckpointError("a stage was lost on every node and there is no complete checkpoint")
        return {i: found[i] for i in layers}

    def _restore(self, storage) -> tuple[int, dict[int, bytes]]:
        found = latest(storage, self.source.count)
        if found is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {self.cfg.checkpoint}")
        return found

    def _checkpoint_due(self, it: int) -> bool:
        """Every K iterations, or once T seconds passed since the last checkpoint
        (the node that writes the barrier record decides, so all agree)."""
        if not self.writer:
            return False
        if self.cfg.checkpoint_every and (it + 1) % self.cfg.checkpoint_every == 0:
            return True
        last = self.cluster.get("checkpointed") or self.began
        return bool(self.cfg.checkpoint_seconds) and time.time() - last >= self.cfg.checkpoint_seconds

    def _checkpoint(self, it: int) -> None:
        """After iteration `it`, pipeline 0's owners snapshot their layers now and
        write them in the background (the next iteration does not wait)."""
        if self.pipeline != 0:
            return
        blobs = {}
        for s in Layout(self.P, frozenset(self.local_failed())).owned(self.me):
            blobs.update(snapshot(dict(zip(self.ranges[s], self.modules[s].layers)), self.optimizers[s]))
        self.writer.write(it + 1, blobs)

    def _silent(self, members, iteration: int, starting=()) -> str | None:
        """Why waiting for `members` is pointless (some lost their leases), or None.
        A node in `starting` may not have registered yet: it counts as alive while
        its agent is, or, without agents, always (the launcher watches it)."""
        if not self.cfg.elastic:
            members, starting = [n for n in members if n not in set(starting)], ()
        gone = self.cluster.record_silent(members, iteration, self.node, starting)
        return f"nodes {gone} lost their leases" if gone else None

    def _world(self, name: str, iteration: int, starting=()) -> Comm:
        """The world process group of the live nodes, under the store prefix `name`;
        the rendezvous gives up (and records them dead) if a member's lease runs out."""
        members = [n for n in self.assignment.members if n not in self.failed_global]
        store = EtcdStore(self.cluster.client, self.cluster.key("pg", "world", name), timedelta(hours=24),
                          lambda: self._silent(members, iteration, starting))
        self._store = store  # the group keeps using it
        pg, rank_of = new_group(store, members, self.node)
        return Comm(pg, rank_of, self.device)

    def local_failed(self) -> tuple[int, ...]:
        return self.assignment.local_failed(self.pipeline, self.failed_global)

    def run(self) -> None:
        it = self.start
        while it < self.cfg.iterations:
            self.failover.begin(it, len(self.mbs), self.local_failed(), self.comm)
            stream = self.failover.base[self.me]  # the failover keeps every node's stream: one compile
            try:
                self.executor.run(it, stream, self.mbs, self.comm, self.failover)
                self._report(it)
                agreed = self._barrier(it)
            except Aborted:
                it = self._switch(it, aborted=True)
                continue
            if agreed["checkpoint"]:
                self._checkpoint(it)
            if agreed["reconfigure"] and it + 1 < self.cfg.iterations:
                it = self._switch(it)
                continue
            it += 1
        if self.writer:
            self.writer.wait()
        self._save()

    def _report(self, it: int) -> None:
        report = {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "events": self.failover.events, "time": time.time(), "epoch": self.assignment.epoch}
        self.failover.events = []
        if self.cfg.check_replicas:
            report["digests"] = {str(s): digest(m, self.optimizers[s]) for s, m in self.modules.items()}
        self.cluster.put(report, "done", it, self.node)

    def _switch(self, it: int, aborted: bool = False) -> int:
        """Move to the agents' next configuration after iteration `it` (or, when `it`
        was abandoned everywhere, after undoing its steps); return the iteration it
        starts from: the next one, `it` again, or a checkpoint's when a stage was lost
        on every node."""
        if aborted:
            self.executor.rollback()
            if self.writer:
                self.writer.wait()  # a checkpoint being written is complete before the agents pick one
            self.cluster.put(True, "aborted", it, self.node)
        new = self.cluster.wait_for(lambda: (lambda a: a if a.epoch > self.assignment.epoch else None)(
            latest_assignment(self.cluster)), timeout=self.cfg.stall_timeout, what="the agents' next configuration")
        self._reconfigure(new, self.assignment)
        self.failed_global = sorted(new.gone)
        self.comm = self._world(f"e{new.epoch}", new.start)
        return new.start

    def _barrier(self, it: int) -> dict:
        """Wait for every live node's report, agree on the failed set, and regroup
        the world without the dead (again, with a new try, if one dies meanwhile).
        Returns the agreed record: also whether to checkpoint, and whether the
        configuration changes before the next iteration."""
        members = self.assignment.members

        def everyone():
            done = self.cluster.children("done", it)
            failed = self.cluster.children("failed")
            pending = [n for n in members if str(n) not in done and str(n) not in failed]
            self.cluster.record_silent(pending, it, self.node)  # died between its stream and its report
            self.failover.check_abort()  # another pipeline could not finish: this iteration is redone
            return not pending
        self.cluster.wait_for(everyone, timeout=24 * 3600, what=f"every node to finish iteration {it}")
        for attempt in itertools.count():
            failed = sorted(int(n) for n in self.cluster.children("failed"))
            due = self._checkpoint_due(it)
            if self.cluster.create({"failed": failed, "reconfigure": self._wants_change(failed), "checkpoint": due},
                                   "regroup", it, attempt) and due:
                self.cluster.put(time.time(), "checkpointed")
            agreed = self.cluster.get("regroup", it, attempt)
            if self.node in agreed["failed"]:
                os._exit(FENCED)  # the others count this node dead: behave as one
            if agreed["reconfigure"] or agreed["failed"] == self.failed_global:
                self.failed_global = agreed["failed"]
                return agreed
            self.failed_global = agreed["failed"]
            try:
                self.comm = self._world(f"{it}-{attempt}", it)
                return agreed
            except (RuntimeError, TimeoutError):
                continue  # a member died while regrouping: the next try leaves it out

    def _wants_change(self, failed: list[int]) -> bool:
        """Under agents: a node of this epoch died or is draining, or a node joined
        that the configuration does not know yet."""
        if not self.cfg.elastic:
            return False
        members = set(self.assignment.members)
        joined = {int(n) for n in self.cluster.children("members")}
        draining = {int(n) for n in self.cluster.children("drain")}
        known = members | set(self.assignment.standby) | set(failed)
        return bool(members & (set(failed) | draining) or (joined - known - draining))

    def _save(self) -> None:
        if not self.cfg.save_dir or self.pipeline != 0:
            return
        os.makedirs(self.cfg.save_dir, exist_ok=True)
        for s in Layout(self.P, frozenset(self.local_failed())).owned(self.me):
            for layer, index in zip(self.modules[s].layers, self.ranges[s]):
                save_layer(layer, os.path.join(self.cfg.save_dir, f"layer{index}.pt"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bamboo.worker")
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--node", type=int, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cluster = Cluster(args.etcd, args.job)
    cfg = JobConfig.from_dict(cluster.get("config"))
    cluster.register(args.node, cfg.failure_timeout, on_lost=lambda: os._exit(FENCED))
    try:
        Worker(cluster, cfg, args.node).run()
    except Exception as e:  # one line in etcd for the launcher, the traceback on stderr
        if str(args.node) in cluster.children("failed"):
            os._exit(FENCED)  # woke up after being declared dead: whatever broke, step aside
        cluster.put(f"{type(e).__name__}: {e}", "error", args.node)
        raise
    # Process groups of an abandoned iteration may still hold a pending collective:
    # leave without running their destructors (which would abort the process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
