"""Measured on real processes: the pause of a rollback from the
checkpoint copies peers keep in memory, beside one from storage, for the same job
and the same kill.

One pipeline of four local nodes (P=4, --max-stages-per-node 1: no standby, no
other pipeline), a checkpoint every K iterations; the nodes on stages 1 and 2 are
SIGKILLed at once (--preempt, the same instruction) in iteration --kill-at, so a
stage is lost on every node and the job goes back to the newest checkpoint: by
default from the copies in memory, with --no-memory-copies from storage. For
each run it prints:

  restore     where the agents went back from (the metrics' redo event)
  pause_s     from the kill to the killed iteration recorded again (the metrics'
              preemption event: detection, the rollback, and the iterations redone)
  detect_s    from the kill to the agents' new epoch in etcd (both deaths recorded,
              every survivor's steps undone): the same work whatever the source
  restore_s   from the new epoch in etcd to the end of the first iteration it
              redoes, less one iteration (iter_s): the layers brought back (from
              peers' memory, or read from storage), the world group formed
  redone      iterations run again (from the checkpoint up to the killed one)
  iter_s      median seconds of an iteration that neither takes a checkpoint nor
              follows the kill
  lost_s      pause_s - redone x iter_s: what the rollback itself cost
  ckpt_s      mean seconds of the iterations that follow a checkpoint boundary
              (before the kill): with copies, their exchange is in it

    python scripts/bench_rollback.py [--rounds 3] [--iterations 16] [--kill-at 9] [--checkpoint-every 4]

Every process runs on this machine, storage is a local directory (the page
cache's best case for storage) and peers' memory is reached over loopback: with
more processes than cores the figures say what the runtime does under
oversubscription, not what separate machines and a remote bucket get.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from results import at_least  # scripts/results.py, beside this file

from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ASSIGNMENT, DONE, PREEMPTED


def watch(cluster: Cluster, marks: dict, stop: threading.Event) -> None:
    """Wall-clock times of the rollback's steps, as etcd shows them: the new epoch
    written ("decided"), and the first iteration it runs done by every member ("redone")."""
    while not stop.is_set():
        if "decided" not in marks and (new := cluster.get(ASSIGNMENT(1))) is not None:
            marks["decided"], marks["epoch"] = time.time(), new
        elif "decided" in marks and len(cluster.children(DONE(marks["epoch"].start))) >= len(marks["epoch"].members):
            marks["redone"] = time.time()
            return
        time.sleep(0.005)


def run(a, memory: bool) -> tuple[list[dict], dict]:
    """One job; its iteration records (every run of each iteration, in order) and
    the times `watch` saw, with the kill's."""
    with tempfile.TemporaryDirectory() as tmp, EtcdServer() as etcd:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "commands.train.cli", "--no-progress", "--metrics-out", metrics,
               "--etcd", etcd.endpoint, "--job", "bench",
               "--model", a.model, "--dtype", "float64", "--seed", "3", "--microbatches", str(a.microbatches),
               "--iterations", str(a.iterations), "--local-nodes", "4", "--zones", "a,b,c", "--stages", "4",
               "--max-stages-per-node", "1", "--checkpoint", a.checkpoint or os.path.join(tmp, "ckpt"),
               "--checkpoint-every", str(a.checkpoint_every),
               "--preempt", f"1@{a.kill_at}:3", "--preempt", f"3@{a.kill_at}:3",  # stages 1 and 2 of (0, 1, 3, 2)
               *([] if memory else ["--no-memory-copies"])]
        cluster, marks, stop = Cluster(etcd.endpoint, "bench", wait=True), {}, threading.Event()
        watcher = threading.Thread(target=watch, args=(cluster, marks, stop), daemon=True)
        watcher.start()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        stop.set()
        watcher.join()
        if out.returncode != 0:
            raise RuntimeError(f"bamboo-train failed:\n{out.stderr[-3000:]}")
        marks["killed"] = min(p.time for p in cluster.children(PREEMPTED()).values())
        cluster.close()
        return [r for r in map(json.loads, open(metrics)) if "summary" not in r], marks


def figures(records: list[dict], marks: dict, a) -> dict:
    redo = next(e for r in records for e in r["events"] if e["type"] == "redo")
    pause = max(e["pause_seconds"] for r in records for e in r["events"] if e["type"] == "preemption")
    redone = a.kill_at - redo["from"]
    first = {}
    for r in records:
        first.setdefault(r["iteration"], r)  # an iteration's first run, before any redo
    after_ckpt = [it for it in first if it and it % a.checkpoint_every == 0 and it < a.kill_at]
    plain = [first[it]["seconds"] for it in first
             if it >= 2 and it not in after_ckpt and it not in range(redo["from"], a.kill_at + 2)]
    iteration = statistics.median(plain)
    return {"restore": redo["restore"], "from": redo["from"], "pause_s": pause, "redone": redone,
            "iter_s": iteration, "lost_s": pause - redone * iteration,
            "detect_s": marks["decided"] - marks["killed"],
            "restore_s": marks["redone"] - marks["decided"] - iteration,
            "ckpt_s": statistics.mean(first[it]["seconds"] for it in after_ckpt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternated")
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--kill-at", type=int, default=9, help="the iteration the two neighbours die in")
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=6)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--checkpoint", help="where storage checkpoints go (default: a fresh local directory)")
    a = ap.parse_args()
    at_least(ap, [("--rounds", a.rounds, 1), ("--checkpoint-every", a.checkpoint_every, 1),
                  ("--microbatches", a.microbatches, 1), ("--kill-at", a.kill_at, a.checkpoint_every + 1),
                  ("--iterations", a.iterations, a.kill_at + 2)])
    if a.checkpoint and os.path.isfile(a.checkpoint):
        ap.error(f"--checkpoint {a.checkpoint!r} is a file, not a directory")
    print(f"# {a.model} float64, M={a.microbatches}, P=4 on 4 local nodes (one pipeline, no standby), "
          f"checkpoint every {a.checkpoint_every}, stages 1 and 2 SIGKILLed in iteration {a.kill_at} "
          f"(instruction 3), {a.iterations} iterations, {a.rounds} rounds, {os.cpu_count()} cores, "
          f"storage: {a.checkpoint or 'a local temp directory'}")
    rows = {"memory": [], "storage": []}
    for _ in range(a.rounds):
        for mode in rows:
            rows[mode].append(figures(*run(a, mode == "memory"), a))
    keys = ("pause_s", "lost_s", "detect_s", "restore_s", "iter_s", "ckpt_s")
    print(f"{'mode':8} {'restore':10} {'from':>4} {'redone':>6} " + " ".join(f"{k:>8}" for k in keys))
    for mode, runs in rows.items():
        for f in runs:
            print(f"{mode:8} {f['restore']:10} {f['from']:4d} {f['redone']:6d} "
                  + " ".join(f"{f[k]:8.3f}" for k in keys))
    print("median:")
    for mode, runs in rows.items():
        print(f"{mode:8} " + " ".join(f"{k} {statistics.median(f[k] for f in runs):.3f}" for k in keys))


if __name__ == "__main__":
    main()
