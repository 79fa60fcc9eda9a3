"""bamboo-chaos: faults injected from outside into a real local job, at random
wall-clock times drawn from --seed, and the job checked against the
single-process reference.

Each trial starts its own etcd and a `bamboo-train --local-nodes` job (agents
with workers, several zones, standby nodes), then, once training runs, injects
faults: SIGKILL of an agent with its worker, SIGKILL of a worker alone, SIGSTOP
of a worker (SIGCONT later), SIGKILL and restart of etcd, every node of a zone at
once, a new node joining, and bursts (commands/chaos/bursts.py): k nodes
killed within one second, at a random time or when the job enters a phase (a
handover, a failover's cut, a redo, a checkpoint, a regroup), sometimes a second
burst while the first is recovered; with --workers-per-host N (machines of N nodes, one
`bamboo-agent --workers N` each), SIGKILL of a whole machine too; with --network
(commands/chaos/network.py), machines that vanish, partitions that heal,
a machine cut off from etcd, the etcd leader killed. Every node killed is
replaced by a new one a little later, as a spot fleet's autoscaler would. After the trial it compares every
iteration's loss with the reference, counts samples lost or trained twice,
and checks that no process it started is left. A failed trial keeps its logs
and prints the seed that reproduces it; a trial that paused as long as only a
timeout ends keeps them too.

    bamboo-chaos --trials 50 --seed 1 --faults 4
    bamboo-chaos --network --trials 30 --seed 1
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from schedules.syncs import SYNC_MODES

from commands.chaos.trial import Outcome, Settings, Trial, account  # noqa: F401 - account: the tests'
from commands.train.flag_checks import check_not_a_file
from bamboo.control.parser import OneLineParser
from commands.chaos.netlab import unavailable
from schedules.options import ReplicaSync


def reference(settings: Settings, directory: str) -> list[float]:
    """Per-iteration losses of the single-process run."""
    path = os.path.join(directory, "reference.jsonl")
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", *settings.train_args(), "--stages", "1",
                          "--no-progress", "--metrics-out", path], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the reference run failed: {out.stderr.strip().splitlines()[-1:]}")
    return [r["loss"] for r in map(json.loads, open(path)) if "summary" not in r]


def _worst(outcomes: list[Outcome]) -> int:
    """The index of the completed trial with the longest pause."""
    return max((i for i, o in enumerate(outcomes) if o.completed), key=lambda i: outcomes[i].pause)


def table(outcomes: list[Outcome], settings: Settings, seed: int) -> str:
    kinds = {k: sum(kind == k for o in outcomes for _, kind, _ in o.faults) for k in settings.kinds}
    pauses = [o.pause for o in outcomes if o.completed]
    rows = [("trials", len(outcomes)),
            ("faults", f"{sum(kinds.values())} ({', '.join(f'{k} {n}' for k, n in kinds.items())})"),
            ("runs completed", sum(o.completed for o in outcomes)),
            ("runs equal to the reference", sum(o.completed and o.equal for o in outcomes)),
            ("samples lost", sum(o.lost for o in outcomes)),
            ("samples trained twice", sum(o.repeated for o in outcomes)),
            ("orphan processes", sum(o.orphans for o in outcomes)),
            ("mean pause (s)", f"{statistics.mean(pauses):.2f}" if pauses else "-"),
            ("worst pause (s)", f"{max(pauses):.2f} (seed {seed + _worst(outcomes)})" if pauses else "-")]
    head = (f"bamboo-chaos: seed {seed}, {settings.nodes} nodes in zones {','.join(settings.zones)}, "
            f"P={settings.stages}, M={settings.microbatches}, {settings.iterations} iterations, "
            f"{settings.faults} faults per trial, checkpoint every {settings.checkpoint_every}, tiny float64"
            + (f", machines of {settings.per_host} nodes" if settings.per_host > 1 else "")
            + (", each machine in its own network namespace, etcd of 3 members" if settings.network else "")
            + (f", --replica-sync {settings.replica_sync}" if settings.replica_sync != ReplicaSync.END else ""))
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)])


def _refused(args) -> str | None:
    """What is wrong with the first flag that is wrong, if one is."""
    most_per_host = args.nodes // Settings.stages
    for ok, why in ((args.trials >= 1, f"--trials must be at least 1 (got {args.trials})"),
                    (args.faults >= 0, f"--faults must not be negative (got {args.faults})"),
                    (args.nodes >= Settings.stages + 1,
                     f"--nodes must be at least {Settings.stages + 1}: P={Settings.stages} and a spare "
                     f"(got {args.nodes})"),
                    (args.iterations >= 2, f"--iterations must be at least 2 (got {args.iterations})"),
                    (1 <= args.workers_per_host <= most_per_host,
                     f"--workers-per-host must be from 1 to --nodes / {Settings.stages} = {most_per_host} "
                     f"(got {args.workers_per_host})")):
        if not ok:
            return why
    try:
        check_not_a_file(args.out, "--out")
    except ValueError as e:
        return str(e)
    return None


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="bamboo-chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50, help="jobs to run, each with its own faults")
    ap.add_argument("--seed", type=int, default=1, help="trial t uses seed SEED + t")
    ap.add_argument("--faults", type=int, default=Settings.faults, help="faults per trial")
    ap.add_argument("--nodes", type=int, help=f"default {Settings.nodes}; 8 with --network (4 machines of 2)")
    ap.add_argument("--iterations", type=int, default=Settings.iterations, help="of each trial's job")
    ap.add_argument("--workers-per-host", type=int, metavar="N",
                    help="machines of N nodes (bamboo-train --local-hosts); adds whole-machine kills to the faults "
                         "(default 1; 2 with --network)")
    ap.add_argument("--network", action="store_true",
                    help="each machine in its own network namespace, etcd of three members; adds vanish, partition, "
                         "etcd-cut and etcd-member-kill (Linux, root)")
    ap.add_argument("--replica-sync", choices=SYNC_MODES, default=Settings.replica_sync,
                    help="the job's replica sync (next: in the next iteration)")
    ap.add_argument("--out", default=None, help="where failed trials keep their logs (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's logs and metrics, not only failed ones'")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers_per_host is None:
        args.workers_per_host = 2 if args.network else 1
    if args.nodes is None:
        args.nodes = 8 if args.network else Settings.nodes
    if args.network and (why := unavailable()):
        print(f"bamboo-chaos: error: --network: {why}", file=sys.stderr)
        return 2
    if why := _refused(args):
        print(f"bamboo-chaos: error: {why}", file=sys.stderr)
        return 2
    settings = Settings(nodes=args.nodes, faults=args.faults, iterations=args.iterations,
                        per_host=args.workers_per_host, network=args.network, replica_sync=args.replica_sync)
    trial = Trial
    if args.network:
        from commands.chaos.network import NetworkTrial as trial
    out = args.out or tempfile.mkdtemp(prefix="bamboo-chaos-")
    os.makedirs(out, exist_ok=True)
    ref = reference(settings, out)
    outcomes = []
    for t in range(args.trials):
        seed = args.seed + t
        o = trial(settings, seed, os.path.join(out, f"trial-{seed}"), ref, args.keep).run()
        outcomes.append(o)
        faults = "; ".join(f"{at}s {kind} {detail}" for at, kind, detail in o.faults)
        verdict = f"ok, pause {o.pause:.1f} s" if o.ok else \
            f"FAILED {o.error or ''} (logs: {o.logs}; rerun: --seed {seed} --trials 1)"
        if o.ok and o.pause >= settings.long_pause:
            verdict += f" (a wait only a timeout ended? logs kept: {o.logs})"
        print(f"trial {t + 1}/{args.trials} seed {seed}: {verdict} | {faults}", flush=True)
    print(table(outcomes, settings, args.seed))
    if not args.out and not any(o.logs for o in outcomes):
        shutil.rmtree(out, ignore_errors=True)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
