"""One worker process: node `--node` of the job, running stage node % P of pipeline
node // P and keeping the replica of the next stage.

    python -m bamboo.worker --etcd HOST:PORT --job NAME --node N

Between iterations every worker writes its report to etcd and waits for every
other live node's; the first to get there fixes the failed set the next iteration
runs with, and the world process group is rebuilt without the dead under a new
epoch prefix. A worker its peers have declared dead stops (exit status FENCED).
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
from bamboo.config import FENCED, JobConfig, local_nodes
from bamboo.data import ByteCorpus, split_microbatches
from bamboo.executor import Executor
from bamboo.failover import Failover
from bamboo.api import ModelSource
from bamboo.checkpoint import CheckpointError, Writer, latest, restore, snapshot, storage_for
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
        self.P, self.D = cfg.stages, cfg.pipelines
        self.pipeline, self.me = divmod(node, self.P)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        source = ModelSource(cfg.model, cfg.seed, cfg.torch_dtype, cfg.seq)
        self.ranges = partition(source.costs(), self.P)
        held = {self.me} | ({(self.me + 1) % self.P} if cfg.redundancy == "eager" else set())
        self.modules = {s: Stage([source.layer(i) for i in self.ranges[s]], source.loss if s == self.P - 1 else None,
                                 self.ranges[s].start).to(self.device) for s in sorted(held)}
        self.optimizers = {s: torch.optim.AdamW(m.parameters(), lr=cfg.lr) for s, m in self.modules.items()}
        corpus = ByteCorpus(list(cfg.data_files), seq=source.seq, batch=cfg.batch, seed=cfg.seed)
        self.mbs = split_microbatches(cfg.microbatches, self.D)[self.pipeline]
        self.failover = Failover(cluster, self.P, self.pipeline, self.me, cfg.redundancy, cfg.failure_timeout)
        self.failed_global: list[int] = []
        reducer = Reducer(cluster, self.P, self.D, node, cfg.failure_timeout)
        self.executor = Executor(cfg, self.pipeline, self.me, self.modules, self.optimizers, corpus,
                                 self.device, reducer, cluster)
        self.start = 0
        self.writer = None
        if cfg.checkpoint:
            storage = storage_for(cfg.checkpoint)
            self.writer = Writer(storage, node)
            if cfg.resume:
                self.start = self._restore(storage, source.count)
        cluster.create(self.start, "start")
        self.comm = self._world("start")

    def _restore(self, storage, num_layers: int) -> int:
        found = latest(storage, num_layers)
        if found is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {self.cfg.checkpoint}")
        iteration, blobs = found
        for s, module in self.modules.items():
            for layer, index in zip(module.layers, self.ranges[s]):
                restore(blobs[index], layer, self.optimizers[s])
        return iteration

    def _checkpoint(self, it: int) -> None:
        """After iteration `it`, pipeline 0's owners snapshot their layers now and
        write them in the background (the next iteration does not wait)."""
        if not self.writer or not self.cfg.checkpoint_every or (it + 1) % self.cfg.checkpoint_every:
            return
        if self.pipeline != 0:
            return
        blobs = {}
        for s in Layout(self.P, frozenset(self.local_failed())).owned(self.me):
            blobs.update(snapshot(dict(zip(self.ranges[s], self.modules[s].layers)), self.optimizers[s]))
        self.writer.write(it + 1, blobs)

    def _world(self, name: str, iteration: int = 0) -> Comm:
        """The world process group of the live nodes, under the store prefix `name`;
        the rendezvous gives up (and records them dead) if a member's lease runs out."""
        members = [n for n in range(self.cfg.nodes) if n not in self.failed_global]

        def silent():
            gone = self.cluster.record_silent(members, iteration, self.node)
            return f"nodes {gone} lost their leases" if gone else None
        store = EtcdStore(self.cluster.client, self.cluster.key("pg", "world", name), timedelta(hours=24), silent)
        self._store = store  # the group keeps using it
        pg, rank_of = new_group(store, members, self.node)
        return Comm(pg, rank_of, self.device)

    def local_failed(self) -> tuple[int, ...]:
        return tuple(sorted(local_nodes(self.P, self.pipeline, self.failed_global)))

    def run(self) -> None:
        for it in range(self.start, self.cfg.iterations):
            self.failover.begin(it, len(self.mbs), self.local_failed(), self.comm)
            stream = self.failover.base[self.me]  # the failover keeps every node's stream: one compile
            self.executor.run(it, stream, self.mbs, self.comm, self.failover)
            report = {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "events": self.failover.events, "time": time.time()}
            self.failover.events = []
            if self.cfg.check_replicas:
                report["digests"] = {str(s): digest(m, self.optimizers[s]) for s, m in self.modules.items()}
            self.cluster.put(report, "done", it, self.node)
            self._barrier(it)
            self._checkpoint(it)
        if self.writer:
            self.writer.wait()
        self._save()

    def _barrier(self, it: int) -> None:
        """Wait for every live node's report, agree on the failed set, and regroup
        the world without the dead (again, with a new try, if one dies meanwhile)."""
        def everyone():
            done = self.cluster.children("done", it)
            failed = self.cluster.children("failed")
            pending = [n for n in range(self.cfg.nodes) if str(n) not in done and str(n) not in failed]
            self.cluster.record_silent(pending, it, self.node)  # died between its stream and its report
            return not pending
        self.cluster.wait_for(everyone, timeout=24 * 3600, what=f"every node to finish iteration {it}")
        for attempt in itertools.count():
            self.cluster.create(sorted(int(n) for n in self.cluster.children("failed")), "epoch", it, attempt)
            agreed = self.cluster.get("epoch", it, attempt)
            if self.node in agreed:
                os._exit(FENCED)  # the others count this node dead: behave as one
            if agreed == self.failed_global:
                return
            self.failed_global = agreed
            try:
                self.comm = self._world(f"{it}-{attempt}", it)
                return
            except (RuntimeError, TimeoutError):
                continue  # a member died while regrouping: the next try leaves it out

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
