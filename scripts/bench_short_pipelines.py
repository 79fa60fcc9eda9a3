"""Measured on real processes: what pipelines shorter than P give, and
what a preemption notice saves.

1. `split`: five local nodes at P=3. With --max-stages-per-node 2 (the default)
   they train as a pipeline of three and one of two (one node on two stages),
   with the global microbatches split by speed; with --max-stages-per-node 1 as
   one pipeline, two nodes idle in standby. Same seed, same samples, same M: the
   losses must agree (printed), and the mean iteration time of each is printed
   with their ratio.
2. `notice`: the pause a node's departure costs (the extra seconds over a
   normal iteration from the iteration it happens in to the first of the epoch
   without it): a drain on an EC2 notice (a fake IMDSv2 on loopback, the agents'
   real watcher) against an unannounced SIGKILL (--preempt), at P=2 with a standby
   node and without one (the survivor then runs both stages), and at P=3 on five
   nodes where the leaving node runs two stages of the short pipeline (killed,
   its pipeline cannot finish the iteration, which is redone).

    python scripts/bench_short_pipelines.py [split|notice|all] [--rounds 2] [--iterations 20]

Every process runs on this machine: with more processes than cores the figures
say what the runtime does under oversubscription, not what separate machines get.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the tests' fake metadata

from bamboo.control.etcd import EtcdServer, connect  # noqa: E402
from bamboo.control.protocol import DONE, scan  # noqa: E402
from tests.fake_metadata import FakeMetadata  # noqa: E402

from results import at_least  # noqa: E402 (scripts/results.py, beside this file)

WARM = 3  # iterations dropped at the start (start-up, first compiles)


def train(args: list[str], etcd: EtcdServer | None = None, during=None) -> list[dict]:
    """One bamboo-train run; its iteration records (each iteration's last, after a redo)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "commands.train.cli", "--no-progress", "--metrics-out", metrics, *args]
        if etcd is not None:
            cmd += ["--etcd", etcd.endpoint]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if during is not None:
            during(proc)
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bamboo-train {' '.join(args)} failed:\n{err[-3000:]}")
        records = [json.loads(line) for line in open(metrics)]
    return list({r["iteration"]: r for r in records if "summary" not in r}.values())


def mean_seconds(records: list[dict]) -> float:
    return statistics.mean(r["seconds"] for r in records[WARM:])


def pipelines_of(records: list[dict]) -> dict:
    return next(e for e in records[0]["events"] if e["type"] == "reconfigure")


def bench_split(a) -> None:
    common = ["--model", "tiny", "--stages", "3", "--local-nodes", "5", "--zones", "a,b,c", "--microbatches",
              str(a.microbatches), "--batch", str(a.batch), "--iterations", str(a.iterations), "--seed", "5"]
    runs: dict[int, list[float]] = {2: [], 1: []}
    losses: dict[int, list[float]] = {}
    shape: dict[int, dict] = {}
    for _ in range(a.rounds):
        for most in (2, 1):
            records = train(common + ["--max-stages-per-node", str(most)])
            runs[most].append(mean_seconds(records))
            losses[most], shape[most] = [r["loss"] for r in records], pipelines_of(records)
    t = {m: statistics.median(v) for m, v in runs.items()}
    worst = max(abs(x - y) / abs(y) for x, y in zip(losses[2], losses[1]))
    print(f"split: tiny, P=3, 5 local nodes, M={a.microbatches}, batch={a.batch}, {a.iterations} iterations "
          f"(first {WARM} dropped), seed 5, float32, {a.rounds} rounds alternating, median of the runs' means; "
          f"{os.cpu_count()} cores for 5 worker processes")
    for most, label in ((2, "short pipelines (--max-stages-per-node 2)"), (1, "one pipeline + 2 standby (1)")):
        print(f"  {label:45} pipelines {shape[most]['pipelines']} standby {shape[most]['standby']} "
              f"microbatches {shape[most].get('microbatches')}: {t[most] * 1e3:8.1f} ms/iteration  "
              f"(runs: {', '.join(f'{x * 1e3:.1f}' for x in runs[most])})")
    print(f"  ratio short/one = {t[2] / t[1]:.3f}; samples/s ratio {t[1] / t[2]:.3f}; "
          f"largest relative loss difference {worst:.2e}")


def wait_done(etcd: EtcdServer, it: int, proc) -> None:
    client = connect(etcd.endpoint)
    try:
        while not any(family is DONE and parts[0] == it for _, family, parts in scan(client)):
            if proc.poll() is not None:
                raise RuntimeError("bamboo-train ended before the notice")
            time.sleep(0.02)
    finally:
        client.close()


def pause(records: list[dict], kind: str) -> tuple[float, int]:
    """(seconds over a normal iteration summed from the iteration whose record has
    the `kind` event to the first one of the epoch that follows it, that
    iteration). Normal: the median of the iterations before it (start-up dropped).
    A redone iteration's record counts the abandoned try and the redo."""
    at = next(r["iteration"] for r in records if any(e["type"] == kind for e in r["events"]))
    end = next(r["iteration"] for r in records[at:] if any(e["type"] == "reconfigure" for e in r["events"]))
    normal = statistics.median(r["seconds"] for r in records[WARM:at])
    return sum(r["seconds"] - normal for r in records[at:end + 1]), at


# name -> (layout flags, the node that leaves, where --preempt kills it)
LAYOUTS = {
    "P=2, 3 nodes, a standby": (["--stages", "2", "--local-nodes", "3", "--max-stages-per-node", "1",
                                 "--zones", "a,b"], 1, 5),
    "P=2, 2 nodes, no standby (survivor takes both)": (["--stages", "2", "--local-nodes", "2", "--zones", "a,b"], 1, 5),
    "P=3, 5 nodes (3+2), the two-stage node leaves": (["--stages", "3", "--local-nodes", "5", "--zones", "a,b,c"],
                                                      3, 9),
}


def leave(a, layout: list[str], victim: int, instruction: int, at: int, notice: bool) -> tuple[float, int]:
    """One run in which node `victim` leaves: SIGKILLed before `instruction` of
    iteration `at`, or noticed (the fake IMDS answers) once iteration `at - 1` is done."""
    base = ["--model", "tiny", "--microbatches", str(a.microbatches), "--batch", str(a.batch),
            "--iterations", str(a.iterations), "--seed", "5", *layout]
    if not notice:
        return pause(train(base + ["--preempt", f"{victim}@{at}:{instruction}"]), "preemption")
    imds = FakeMetadata()
    with EtcdServer() as etcd:
        def notify(proc):
            wait_done(etcd, at - 1, proc)
            imds.noticed.add(str(victim))
        records = train(base + ["--notice", "ec2", "--metadata-url", imds.url + "/{node}"], etcd, notify)
    imds.shutdown()
    return pause(records, "notice")


def bench_notice(a) -> None:
    at = a.iterations // 2
    out: dict[tuple[str, bool], list[tuple[float, int]]] = {}
    for _ in range(a.rounds):
        for name, (layout, victim, instruction) in LAYOUTS.items():
            for notice in (False, True):
                out.setdefault((name, notice), []).append(leave(a, layout, victim, instruction, at, notice))
    print(f"notice: tiny, M={a.microbatches}, batch={a.batch}, {a.iterations} iterations, seed 5, eager; the node "
          f"is SIGKILLed in iteration {at} (--preempt) or gets an EC2 notice once iteration {at - 1} is done (the "
          f"agents' watcher polls every 0.2 s; it drains at the next boundary); pause = seconds over the median "
          f"iteration, from the iteration of the kill or notice to the new epoch's first, inclusive; "
          f"{a.rounds} rounds, median; {os.cpu_count()} cores")
    for name in LAYOUTS:
        kill = statistics.median(p for p, _ in out[(name, False)])
        noticed = statistics.median(p for p, _ in out[(name, True)])
        print(f"  {name:48} SIGKILL {kill * 1e3:8.1f} ms   notice {noticed * 1e3:8.1f} ms   "
              f"(runs: {[round(p * 1e3) for p, _ in out[(name, False)]]} / "
              f"{[round(p * 1e3) for p, _ in out[(name, True)]]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("split", "notice", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    at_least(ap, [("--rounds", a.rounds, 1), ("--iterations", a.iterations, 2), ("--microbatches", a.microbatches, 1),
                  ("--batch", a.batch, 1)])
    if a.what in ("split", "all"):
        bench_split(a)
    if a.what in ("notice", "all"):
        bench_notice(a)


if __name__ == "__main__":
    main()
