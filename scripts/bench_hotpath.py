"""The hot path: Bamboo's no-redundancy pipeline against DeepSpeed's PipelineEngine
and torch.distributed.pipelining's Schedule1F1B, then where Bamboo's time goes.

The model is the project's own GPT layers (bamboo/model/builtin.py: Embedding, 4 Blocks,
Head; dim 256, 4 heads, seq 128, byte vocabulary, dropout 0: 3.32M parameters; with
--shape large 12 Blocks of dim 768, 12 heads, seq 256, 2 sequences per microbatch),
given to bamboo-train by this file's factory (`--model scripts.bench_hotpath:gpt`).
The baselines build layer i from (seed, i) the same way (ModelSource.layer), split
the stages as Bamboo does and draw Bamboo's samples (Corpus.microbatch(i, g)).
P=2, D=1, M=8, batch 8, gloo on the CPU, one process per stage with one torch
thread, AdamW from bamboo/model/recipe.py (lr 1e-3, betas 0.9/0.999, decay 0.01 on
matrices). Dropout is 0: the baselines have no per-microbatch dropout seeds.

Iteration time: the steady period of iteration ends on the nodes' own clocks
(the first --warm iterations dropped): Bamboo's reports (done/<it>/<node>, written
before the barrier), the baselines' returns from train_batch / step. Systems
alternate within each round, in reverse order every other round (the same code run
first and last in a round differed by 2%); medians over rounds. Bamboo runs on one etcd started
here (the launcher's binary and flags) whose /metrics are read. "off-poll1s" is
off with the launcher's 50 ms poll stretched to 1 s (time.sleep patched in the
launcher process only, by a sitecustomize): what that polling costs the workers.
"off-ahead" is off with --compute-ahead: what running stage 0's next forward during
the boundary gains (bamboo/runtime/ahead.py). "off-whole" is off with
--backward-split off: what sending input gradients before weight passes gains
(schedules/early_grads.py). "torch-zb" is torch's ScheduleInterleavedZeroBubble on
the same single stage per rank: torch's own split backwards, its best setting here.

--profile DIR then measures, per iteration: every process's CPU and etcd's
requests (by difference of an N- and a 2N-iteration run), and each main
thread's time under cProfile (a sitecustomize again: bamboo/ is not changed).

    python scripts/bench_hotpath.py [--shape small|large] [--rounds 3] [--iterations 12] [--warm 3]
                                     [--systems off,deepspeed,...] [--profile DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter

import torch
import torch.nn as nn

from bamboo.model.builtin import Block, Embedding, GPTConfig, Head, token_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --shape: the model and the sequences per microbatch. "large" is where per-message and
# per-op overheads weigh less against the compute. The workers and the baselines' ranks
# read the shape from SHAPE_ENV, which main sets for every process it starts.
SHAPES = {"small": (GPTConfig(vocab=256, seq=128, dim=256, layers=4, heads=4, dropout=0.0), 8),
          "large": (GPTConfig(vocab=256, seq=256, dim=768, layers=12, heads=12, dropout=0.0), 2)}
SHAPE_ENV = "BAMBOO_BENCH_SHAPE"
CFG, BATCH = SHAPES.get(os.environ.get(SHAPE_ENV, "small"), SHAPES["small"])
MODEL, P, M = "scripts.bench_hotpath:gpt", 2, 8
SYSTEMS = ("off", "deepspeed", "torch", "eager", "lazy", "off-poll1s", "off-ahead", "off-whole",
           "torch-zb")  # the first round's order
BASELINES = ("deepspeed", "torch", "torch-zb")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT}


def gpt() -> nn.Sequential:
    """The factory bamboo-train calls (on the meta device): the built-in GPT layers."""
    return nn.Sequential(Embedding(CFG, 0), *[Block(CFG, i) for i in range(1, CFG.layers + 1)],
                         Head(CFG, CFG.layers + 1))


def setup(seed: int):
    """What every baseline rank shares with Bamboo's workers: the layers from
    (seed, i), Bamboo's stage ranges, the corpus, the job's recipe settings."""
    from bamboo.control.config import JobConfig
    from bamboo.data.corpus import corpus_of
    from bamboo.model.api import ModelSource
    from bamboo.model.partition import partition
    cfg = JobConfig.of(name=MODEL, seq=CFG.seq, batch=BATCH, seed=seed, microbatches=M, stages=P)
    source = ModelSource(MODEL, seed, seq=CFG.seq)
    return [source.layer(i) for i in range(source.count)], partition(source.costs(), P), corpus_of(cfg, CFG.seq), cfg


# -- the baselines, one process per rank ------------------------------------------------
def deepspeed_stepper(rank: int, layers, ranges, corpus, cfg):
    """DeepSpeed's PipelineEngine with nothing extra: no timers, no activation
    checkpointing, no clipping, the client AdamW used as it is (fp32, no ZeRO)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from bamboo.model import recipe
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    module = PipelineModule(layers=layers, num_stages=P, loss_fn=token_loss, partition_method="parameters",
                            activation_checkpoint_interval=0)
    assert module.parts == [r.start for r in ranges] + [ranges[-1].stop], (module.parts, ranges)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": M,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=module, optimizer=recipe.optimizer(module, cfg.recipe), config=config)
    return lambda it: float(engine.train_batch(iter([corpus.microbatch(it, g) for g in range(M)])))


def torch_stepper(rank: int, layers, ranges, corpus, cfg, zero_bubble: bool = False):
    """torch.distributed.pipelining: one PipelineStage per rank, Schedule1F1B with
    its defaults (gradients scaled by 1/M), outputs not gathered (unused). With
    `zero_bubble` ("torch-zb"): ScheduleInterleavedZeroBubble on the same single
    stage per rank, torch's schedule that splits backwards into input and weight
    passes (Qi et al.'s ZB1P) as Bamboo's --backward-split does for the last ones."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

    from bamboo.model import recipe
    dist.init_process_group("gloo")
    module = nn.Sequential(*[layers[i] for i in ranges[rank]])
    optimizer = recipe.optimizer(module, cfg.recipe)
    stage = PipelineStage(module, rank, P, torch.device("cpu"))
    schedule = ScheduleInterleavedZeroBubble([stage], M, loss_fn=token_loss) if zero_bubble else \
        Schedule1F1B(stage, M, loss_fn=token_loss)

    def step(it: int):
        x, y = (torch.cat(t) for t in zip(*(corpus.microbatch(it, g) for g in range(M))))
        optimizer.zero_grad(set_to_none=True)
        losses: list = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        optimizer.step()
        return sum(float(v) for v in losses) / M if losses else None
    return step


def baseline_rank(a) -> None:
    """One rank of a baseline (this script, started by run_baseline)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(a.rank),
                      WORLD_SIZE=str(P), LOCAL_RANK=str(a.rank))
    torch.set_num_threads(1)
    layers, ranges, corpus, cfg = setup(a.seed)
    step = deepspeed_stepper(a.rank, layers, ranges, corpus, cfg) if a.role == "deepspeed" else \
        torch_stepper(a.rank, layers, ranges, corpus, cfg, zero_bubble=a.role == "torch-zb")
    ends, losses = [], []
    for it in range(a.iterations):
        losses.append(step(it))
        ends.append(time.time())
    with open(a.out, "w") as f:
        json.dump({"ends": ends, "losses": losses}, f)
    # Out without the interpreter's teardown: a gloo thread still alive there can abort
    # the process ("terminate called without an active exception") after its run is done.
    os._exit(0)


def run_baseline(system: str, a, iterations: int | None = None, env=ENV) -> dict:
    """Both ranks of `system`; iteration ends are the later rank's."""
    from bamboo.control.etcd import free_port
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", system, "--rank", str(r),
                                   "--port", str(port), "--out", f"{d}/{r}.json", "--iterations",
                                   str(iterations or a.iterations), "--seed", str(a.seed), "--shape", a.shape],
                                  cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(f"{d}/{r}.log", "w")) for r in range(P)]
        failed = [r for r, p in enumerate(procs) if p.wait()]
        if failed:
            raise RuntimeError(f"{system} failed: " + "".join(f"\nrank {r}, exit {procs[r].returncode}:\n"
                                                            + open(f"{d}/{r}.log").read()[-3000:] for r in failed))
        ranks = [json.load(open(f"{d}/{r}.json")) for r in range(P)]
    return {"ends": [max(t) for t in zip(*(r["ends"] for r in ranks))], "losses": ranks[-1]["losses"]}


# -- Bamboo ------------------------------------------------------------------------------
def run_bamboo(mode: str, a, etcd: str, iterations: int | None = None, env=ENV, extra=()) -> dict:
    """bamboo-train with --redundancy `mode` (and `extra` flags) on `etcd`; iteration ends from the reports."""
    from bamboo.control.cluster import Cluster
    from bamboo.control.protocol import DONE
    n, job = iterations or a.iterations, f"hot-{mode}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--model", MODEL,
                        "--seq", str(CFG.seq), "--stages", str(P), "--microbatches", str(M), "--batch", str(BATCH),
                        "--iterations", str(n),
                        "--seed", str(a.seed), "--redundancy", mode, "--etcd", etcd, "--job", job,
                        "--metrics-out", f"{d}/m.jsonl", *extra], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in open(f"{d}/m.jsonl")][:-1]
    cluster = Cluster(etcd, job)
    reports = [cluster.children(DONE(it)).values() for it in range(n)]
    cluster.close()
    return {"ends": [max(r.time for r in done) for done in reports], "losses": [r["loss"] for r in records],
            "launcher": [r["seconds"] for r in records], "busy": [max(r.busy for r in done) for done in reports]}


def period(ends: list[float], warm: int) -> float:
    """Mean time between iteration ends after the warm-up."""
    return (ends[-1] - ends[warm - 1]) / (len(ends) - warm)


def compare_losses(runs: dict, check: int, rtol: float) -> None:
    """Print the first iterations' losses of every system and assert they match."""
    print(f"\nlosses of the first {check} iterations (round 1); every round checked, rtol {rtol:g}")
    print("it  " + "".join(f"{s:>12}" for s in runs))
    for it in range(check):
        print(f"{it:<4}" + "".join(f"{runs[s][0]['losses'][it]:12.6f}" for s in runs))
    want = runs["off"][0]["losses"][:check]
    for s in runs:
        worst = max(abs(r["losses"][i] - want[i]) / abs(want[i]) for r in runs[s] for i in range(check))
        print(f"  {s:10} largest relative difference from off: {worst:.2e}")
        assert worst <= rtol, f"{s}'s losses differ from Bamboo's: {worst:.2e}"


def report_times(runs: dict, a) -> None:
    from results import interval  # here: the workers import this module as the model's factory
    t = {s: statistics.median(period(r["ends"], a.warm) for r in runs[s]) for s in runs}
    launcher = statistics.median(statistics.mean(r["launcher"][a.warm:]) for r in runs["off"])
    print(f"\nmedian iteration time over {a.rounds} rounds (iterations {a.warm}..{a.iterations - 1} of each run):")
    for s in runs:
        print(f"  {s:10} {t[s] * 1e3:8.1f} ms   per round: "
              + " ".join(f"{period(r['ends'], a.warm) * 1e3:.1f}" for r in runs[s]))
    busy = statistics.median(statistics.mean(r["busy"][a.warm:]) for r in runs["off"])
    print(f"  (off as the launcher's metrics record it: {launcher * 1e3:.1f} ms; the busier node's compute ops, "
          f"Executor.busy: {busy * 1e3:.1f} ms)")
    pairs = [(x, y) for x, y in (("off", "deepspeed"), ("off", "torch"), ("off", "torch-zb"), ("eager", "off"),
                                 ("lazy", "off"), ("off-poll1s", "off"), ("off-poll1s", "deepspeed"),
                                 ("off-ahead", "off"), ("off-ahead", "deepspeed"), ("off-ahead", "torch"),
                                 ("off-ahead", "torch-zb"), ("off-whole", "off"),
                                 ("off-whole", "deepspeed")) if x in runs and y in runs]
    print("ratios: " + "   ".join(f"{x}/{y} {t[x] / t[y]:.3f}" for x, y in pairs))
    # The systems alternate within a round: a ratio inside one round is the least
    # touched by the machine's load drifting from round to round.
    def within_rounds(x: str, y: str) -> float:
        return statistics.median(period(rx["ends"], a.warm) / period(ry["ends"], a.warm)
                                 for rx, ry in zip(runs[x], runs[y]))
    print("median of the rounds' own ratios: " + "   ".join(f"{x}/{y} {within_rounds(x, y):.3f}" for x, y in pairs))
    if a.rounds >= 2:
        print("geometric mean of the rounds' own ratios, 95% interval over rounds (Student's t): " + "   ".join(
            "{}/{} {:.3f} [{:.3f}, {:.3f}]".format(x, y, *interval(
                [period(rx["ends"], a.warm) / period(ry["ends"], a.warm) for rx, ry in zip(runs[x], runs[y])]))
            for x, y in pairs))


# -- where the time goes -----------------------------------------------------------------
SITE = """import os, sys
if os.environ.get("BENCH_SLOW_POLL") and "--metrics-out" in sys.argv:  # the launcher: poll every 1 s
    import time
    _sleep = time.sleep
    time.sleep = lambda s: _sleep(1.0 if s == 0.05 else s)
if os.environ.get("BENCH_PROFILE"):  # scripts/bench_hotpath.py: this process's CPU (and profile) at exit
    import atexit, cProfile, json
    _profile, _done = cProfile.Profile() if os.environ.get("BENCH_CPROFILE") else None, []
    _profile and _profile.enable()

    def _dump():
        if not _done:
            _done.append(1)
            base, t = os.path.join(os.environ["BENCH_PROFILE"], str(os.getpid())), os.times()
            if _profile:
                _profile.disable()
                _profile.dump_stats(base + ".prof")
            with open(base + ".json", "w") as f:
                json.dump({"argv": sys.argv, "cpu": t.user + t.system}, f)
    atexit.register(_dump)
    _exit = os._exit
    os._exit = lambda status: (_dump(), _exit(status))
"""


def traced(out: str, cprofile: bool = False, slow_poll: bool = False) -> dict:
    """The environment of a run whose Python processes leave their CPU seconds (and
    with `cprofile` their main thread's profile) in `out`: a sitecustomize on
    PYTHONPATH, so nothing in bamboo/ changes."""
    os.makedirs(os.path.join(out, "site"), exist_ok=True)
    with open(os.path.join(out, "site", "sitecustomize.py"), "w") as f:
        f.write(SITE)
    return {**ENV, "BENCH_PROFILE": out, "BENCH_CPROFILE": "1" if cprofile else "",
            "BENCH_SLOW_POLL": "1" if slow_poll else "", "PYTHONPATH": os.path.join(out, "site") + os.pathsep + ROOT}


def processes(out: str) -> dict[str, tuple[dict, str]]:
    """role -> (what the process wrote at exit, its profile's path)."""
    found = {}
    for name in (f for f in os.listdir(out) if f.endswith(".json")):
        meta = json.load(open(os.path.join(out, name)))
        argv = meta["argv"]
        role = (f"worker {argv[argv.index('--node') + 1]}" if "--node" in argv else
                f"{argv[argv.index('--role') + 1]} rank {argv[argv.index('--rank') + 1]}" if "--rank" in argv else
                "launcher" if argv[0].endswith("cli.py") else None)
        if role:
            found[role] = (meta, os.path.join(out, name.replace(".json", ".prof")))
    return found


def etcd_counters(endpoint: str) -> Counter:
    """etcd's own counters: gRPC messages received per method, its CPU seconds, WAL fsyncs."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    found: Counter = Counter()
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            found["etcd " + re.search(r'grpc_method="(\w+)"', line)[1]] += float(line.rsplit(" ", 1)[1])
        elif line.startswith(("process_cpu_seconds_total ", "etcd_disk_wal_fsync_duration_seconds_sum ",
                              "etcd_disk_wal_fsync_duration_seconds_count ")):
            name, value = line.split()
            found["etcd " + name] = float(value)
    return found


def per_iteration(a, etcd: str, out: str) -> None:
    """CPU seconds of every process and etcd's requests per iteration, by difference
    of an N- and a 2N-iteration run (start-up and shutdown cancel out)."""
    print(f"\nper iteration, from ({2 * a.iterations} - {a.iterations} iterations) / {a.iterations}:")
    for system in ("off", "deepspeed", "torch"):
        runs = []
        for n in (a.iterations, 2 * a.iterations):
            d, before = tempfile.mkdtemp(dir=out), etcd_counters(etcd)
            if system == "off":
                run_bamboo(system, a, etcd, n, traced(d))
            else:
                run_baseline(system, a, n, traced(d))
            after = etcd_counters(etcd) if system == "off" else before
            runs.append(Counter({**{k: after[k] - before[k] for k in after},
                                 **{f"CPU s, {role}": m["cpu"] for role, (m, _) in processes(d).items()}}))
        for key in sorted(runs[1], key=lambda k: (not k.startswith("CPU"), k)):
            if (value := (runs[1][key] - runs[0][key]) / a.iterations) > 0.005:
                print(f"  {system:10} {key:50} {value:9.3f}")


def calls(stats: pstats.Stats, where: str, name: str, caller: str | None = None) -> tuple[int, float]:
    """(calls, cumulative seconds) of functions `name` in files ending `where`
    (from `caller`'s call sites only, when given: pstats keeps that per caller)."""
    n, t = 0, 0.0
    for (file, _, func), (_, nc, _, ct, callers) in stats.stats.items():
        if file.endswith(where) and func == name:
            for (_, _, cfunc), (_, cnc, _, cct) in callers.items() if caller else [(("", 0, ""), (0, nc, 0, ct))]:
                if caller is None or cfunc == caller:
                    n, t = n + cnc, t + cct
    return n, t


WORKER = [  # (what, file, function, caller): a worker's main thread
    ("stream + linger (run_iteration)", "worker.py", "run_iteration", None),
    ("  forward", "executor.py", "forward", None), ("  backward, loss write included", "executor.py", "backward", None),
    ("    loss writes to etcd", "cluster.py", "put", "backward"), ("  step", "executor.py", "optimizer_step", None),
    ("  recv waits (gloo; polls included)", "comm.py", "recv", None),
    ("  send waits (gloo; polls included)", "comm.py", "send", None),
    ("  failover polls between instructions", "failover.py", "poll", "run"),
    ("  finished + linger", "failover.py", "linger", None), ("", "failover.py", "finished", None),
    ("boundary: report", "boundary.py", "report", None), ("boundary: agree (barrier)", "boundary.py", "agree", None),
    ("etcd requests (all, as Cluster.call)", "cluster.py", "call", None),
    ("time.sleep (all)", "~", "<built-in method time.sleep>", None)]
LAUNCHER = [("waiting for reports (the 50 ms poll)", "launcher.py", "_wait_iteration", None),
            ("etcd requests (all, as Cluster.call)", "cluster.py", "call", None),
            ("time.sleep", "~", "<built-in method time.sleep>", None)]


def profile(a, etcd: str, out: str) -> None:
    """One off run with every Python process under cProfile: per iteration, what
    each main thread did (cProfile's overhead inflates Python-heavy parts)."""
    run = run_bamboo("off", a, etcd, env=traced(out, cprofile=True))
    n = a.iterations
    print(f"\nprofiled off run: {period(run['ends'], a.warm) * 1e3:.1f} ms per iteration under cProfile; "
          f"totals / {n} iterations, ms (calls):")
    for role, (meta, path) in sorted(processes(out).items()):
        print(f"  {role}")
        for what, where, name, caller in WORKER if role.startswith("worker") else LAUNCHER:
            c, t = calls(pstats.Stats(path), where, name, caller)
            if what and c:
                print(f"    {what:42} {t / n * 1e3:8.1f} ms  ({c / n:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small",
                    help="small: dim 256, 4 blocks, seq 128, batch 8; large: dim 768, 12 blocks, seq 256, batch 2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=14)
    ap.add_argument("--warm", type=int, default=5,
                    help="iterations dropped at the start of each run (eager places FRC by measured op times "
                         "from iteration 4)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="which systems each round runs, in this order, reversed every other round "
                         "(off among them; default: all)")
    ap.add_argument("--check", type=int, default=5, help="iterations whose losses are compared")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="DIR", help="then find where Bamboo's time goes (profiles land here)")
    ap.add_argument("--role", choices=BASELINES, help=argparse.SUPPRESS)  # a baseline's rank
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global CFG, BATCH
    CFG, BATCH = SHAPES[a.shape]
    ENV[SHAPE_ENV] = os.environ[SHAPE_ENV] = a.shape  # every process started here, and the factory here
    if a.role:
        return baseline_rank(a)
    a.systems = tuple(a.systems.split(","))
    if "off" not in a.systems or set(a.systems) - set(SYSTEMS):
        ap.error(f"--systems: a comma-separated list of {', '.join(SYSTEMS)}, with off among them")
    if a.rounds < 0 or a.warm < 1 or a.iterations < a.warm + 2 or not 1 <= a.check <= a.iterations:
        ap.error(f"need --rounds >= 0 (0: only --profile), --warm >= 1, --iterations >= --warm + 2 and "
                 f"1 <= --check <= --iterations (got {a.rounds}, {a.warm}, {a.iterations}, {a.check})")
    if not a.rtol > 0 or a.rtol == float("inf") or a.seed < 0:
        ap.error(f"--rtol must be a finite number above 0 and --seed at least 0 (got {a.rtol} and {a.seed})")
    from bamboo.control.etcd import EtcdServer
    params = sum(p.numel() for layer in setup(a.seed)[0] for p in layer.parameters())
    print(f"GPT {MODEL} ({params / 1e6:.2f}M parameters: dim {CFG.dim}, {CFG.layers} blocks, {CFG.heads} heads, "
          f"seq {CFG.seq}, vocab {CFG.vocab}, dropout 0), P={P} D=1 M={M} batch {BATCH}, seed {a.seed}, "
          f"{a.iterations} iterations per run, gloo on the CPU, one process per stage, 1 torch thread each, "
          f"AdamW lr 1e-3 betas 0.9/0.999 decay 0.01, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}"
          + "".join(f"; every system's processes with {k}={v}" for k, v in ENV.items() if k.startswith("MALLOC_")))
    with EtcdServer() as etcd, tempfile.TemporaryDirectory() as scratch:
        runs: dict[str, list] = {s: [] for s in a.systems}
        for r in range(a.rounds):
            for s in a.systems if r % 2 == 0 else a.systems[::-1]:  # no system always first
                if s in BASELINES:
                    runs[s].append(run_baseline(s, a))
                else:
                    env = traced(tempfile.mkdtemp(dir=scratch), slow_poll=True) if s == "off-poll1s" else ENV
                    extra = {"off-ahead": ("--compute-ahead",), "off-whole": ("--backward-split", "off")}.get(s, ())
                    runs[s].append(run_bamboo(s.split("-")[0], a, etcd.endpoint, env=env, extra=extra))
        if a.rounds:
            compare_losses(runs, a.check, a.rtol)
            report_times(runs, a)
            print(f"load average after the rounds: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
        if a.profile:
            os.makedirs(a.profile, exist_ok=True)
            per_iteration(a, etcd.endpoint, a.profile)
            profile(a, etcd.endpoint, tempfile.mkdtemp(dir=a.profile))


if __name__ == "__main__":
    main()
