"""End to end: real worker processes, a real etcd, real gloo, a real SIGKILL.

Every distributed run (P=4, D=2, M=8, 10 iterations of `tiny`) is compared with
the single-process reference on the same samples: per-iteration losses, sample
counts and final parameters. float64 keeps summation-order noise far below the
tolerance, so any lost or double-counted microbatch shows.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from schedules.compiler import compile_recovery, compile_schedule
from schedules.ir import INPUT_GRADS, Op

from tests.training import bamboo_train
from schedules.options import ScheduleOptions
from bamboo.control.config import JobConfig

P, D, M, ITERS = 4, 2, 8, 10
COMMON = ["--model", "tiny", "--microbatches", str(M), "--iterations", str(ITERS), "--seed", "3",
          "--dtype", "float64"]
RTOL = 1e-5


def train(tmp_path, name, *args, check=True):
    params = tmp_path / f"{name}-params"
    out, records = bamboo_train(tmp_path / f"{name}.jsonl", *COMMON, "--save-dir", str(params), *args, check=check)
    return out, records, params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    _, records, params = train(tmp, "reference", "--stages", "1", "--pipelines", "1")
    return records, params


def assert_same_training(records, params, reference):
    ref_records, ref_params = reference
    assert [r["iteration"] for r in records] == list(range(ITERS))
    for got, want in zip(records, ref_records):
        assert got["samples"] == want["samples"]
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"iteration {got['iteration']}"
    files = sorted(os.listdir(ref_params))
    assert files == sorted(os.listdir(params)) and len(files) == 8  # embedding, 6 blocks, head
    for f in files:
        a, b = torch.load(ref_params / f), torch.load(params / f)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=1e-9)


def kill_point(node: int, pick, mode: str = "eager") -> str:
    """NODE@5:INSTR with INSTR chosen by `pick` from the node's iteration-5 stream."""
    stream = compile_schedule(P, M // D, (), options=ScheduleOptions(redundancy=mode)).streams[node % P]
    return f"{node}@5:{pick(stream)}"


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_without_redundancy(tmp_path, reference):
    _, records, params = train(tmp_path, "off", "--stages", str(P), "--pipelines", str(D), "--redundancy", "off")
    assert_same_training(records, params, reference)


@pytest.mark.slow  # make test-slow; the agents' tests check replicas in every run of make test
def test_eager_redundancy_keeps_replicas_equal_to_owners(tmp_path, reference):
    _, records, params = train(tmp_path, "eager", "--stages", str(P), "--pipelines", str(D), "--check-replicas")
    assert_same_training(records, params, reference)
    assert all(r["replicas_equal"] for r in records)


def _backward_of_first_stage(stream):
    return next(i for i, x in enumerate(stream) if x.op is Op.BACKWARD and x.mb == 1)


def _mid_stream(stream):
    reduce_at = next(i for i, x in enumerate(stream) if x.op is Op.REDUCE_GRADS)
    return reduce_at // 2


def _first_forward(stream):
    return next(i for i, x in enumerate(stream) if x.op is Op.FORWARD)


@pytest.mark.parametrize("mode,node,pick", [
    ("eager", 0, _backward_of_first_stage),   # first stage, during its backward phase
    pytest.param("eager", 3, _mid_stream, marks=pytest.mark.slow),  # last stage (make test-slow)
    pytest.param("eager", 6, _first_forward, marks=pytest.mark.slow),  # second pipeline, before it sent anything
    pytest.param("lazy", 5, _mid_stream, marks=pytest.mark.slow),  # lazy: FRC and BRC of stage 1 after the death
], ids=["first-stage-backward", "last-stage", "pipeline1-start", "lazy-mid-stream"])
def test_sigkill_mid_iteration_keeps_the_math(tmp_path, reference, mode, node, pick):
    point = kill_point(node, pick, mode)
    _, records, params = train(tmp_path, "kill", "--stages", str(P), "--pipelines", str(D), "--redundancy", mode,
                               "--preempt", point, "--check-replicas")
    assert_same_training(records, params, reference)
    events = records[5]["events"]
    assert {"preemption", "failover"} == {e["type"] for e in events}, events
    failover = next(e for e in events if e["type"] == "failover")
    assert failover["node"] == node and failover["by"] == (node // P) * P + (node - 1) % P
    assert [r["nodes"] for r in records] == [P * D] * 5 + [P * D - 1] * (ITERS - 5)
    assert all(r["replicas_equal"] for r in records)


@pytest.mark.slow
def test_sigkill_with_frc_only_in_the_bubbles_keeps_the_math(tmp_path, reference):
    """Bounded eager (--frc bubbles, the default) on one pipeline of M=8: node 1's
    bubbles hold its FRC of stage 2 for microbatches 0 and 1 only (its split
    backwards' weight passes take the other waits). Node 2 dies just before its
    reduce, so node 1 swaps in 0 and 1 and recomputes 2 to 7 (so says the compiler,
    checked first), and training goes on exactly as the reference."""
    k = next(i for i, x in enumerate(compile_schedule(P, M).streams[2]) if x.op is Op.REDUCE_GRADS)
    rec = compile_recovery(P, M, 2, k)
    recovery = rec.streams[1][rec.resume_at[1]:]
    assert {x.mb for x in recovery if x.op is Op.SWAP_IN and x.stage == 2} == {0, 1}
    assert sorted(x.mb for x in recovery if x.op is Op.FORWARD and x.stage == 2) == [2, 3, 4, 5, 6, 7]
    _, records, params = train(tmp_path, "bounded", "--stages", str(P), "--pipelines", "1", "--frc", "bubbles",
                               "--preempt", f"2@5:{k}", "--check-replicas")
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}
    assert [r["nodes"] for r in records] == [P] * 5 + [P - 1] * (ITERS - 5)
    assert all(r["replicas_equal"] for r in records)


@pytest.mark.slow  # make test-slow: the placement before bounded eager
def test_sigkill_with_frc_for_every_microbatch_keeps_the_math(tmp_path, reference):
    stream = compile_schedule(P, M // D, (), options=ScheduleOptions(redundancy="eager", frc="all")).streams[3]
    _, records, params = train(tmp_path, "all", "--stages", str(P), "--pipelines", str(D), "--frc", "all",
                               "--preempt", f"3@5:{_mid_stream(stream)}", "--check-replicas")
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}


@pytest.mark.slow
def test_lazy_replica_steps_taken_late_keep_the_math(tmp_path, reference):
    """Without --check-replicas lazy owes a replica's step and takes it in the holder's
    first wait after the gradients came (its linger, the boundary, or the next
    iteration's first receive) or before anything reads the replica: node 5 dies
    mid-stream, so its holder takes the stage over stepped (a replica one step behind
    would change pipeline 1's gradients, and every later loss)."""
    point = kill_point(5, _mid_stream, "lazy")
    _, records, params = train(tmp_path, "lazy-late", "--stages", str(P), "--pipelines", str(D),
                               "--redundancy", "lazy", "--preempt", point)
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}


@pytest.mark.slow  # random kill points: bamboo-chaos covers them from outside in make test
def test_random_kill_point(tmp_path, reference):
    _, records, params = train(tmp_path, "random", "--stages", str(P), "--pipelines", str(D), "--preempt", "random")
    assert_same_training(records, params, reference)
    assert sum(e["type"] == "preemption" for r in records for e in r["events"]) == 1


@pytest.mark.parametrize("args,message,code", [
    (["--stages", "9"], "more than model tiny's 8 layers", 2),
    (["--stages", "2", "--preempt", "7@1"], "out of range", 2),
    (["--stages", "2", "--preempt", "x"], "NODE@ITERATION", 2),
    (["--stages", "2", "--preempt", "1@0:999"], "instructions an iteration", 2),
    (["--stages", "2", "--microbatches", "1", "--pipelines", "2"], "fewer than --pipelines", 2),
    (["--stages", "2", "--etcd", "127.0.0.1:1"], "unreachable", 1),
    (["--stages", "2", "--etcd", "nonsense"], "HOST:PORT", 2),
    (["--stages", "2", "--etcd", "127.0.0.1:1,"], "an empty endpoint is not HOST:PORT", 2),
    (["--stages", "2", "--etcd", "127.0.0.1:1,127.0.0.1:2"], "unreachable", 1),
    (["--stages", "2", "--etcd-members", "2"], "--etcd-members must be 1, 3, 5 or 7", 2),
    (["--stages", "2", "--etcd", "127.0.0.1:1", "--etcd-members", "3"], "the etcd is yours", 2),
    (["--model", "math:sqrt"], "the factory failed (TypeError", 2),
    (["--model", "math:pi"], "is a float, not a function", 2),
    (["--stages", "2", "--preempt", "1@-1"], "would never fire", 2),
    (["--stages", "2", "--preempt", "1@1"], "would never fire", 2),  # one iteration: only 0 exists
    (["--metrics-out", "/proc/no/m.jsonl"], "cannot write there", 2),
    (["--stages", "2", "--local-nodes", "2", "--join", "1@0"], "the job's last is 0", 2),
    (["--stages", "2", "--redundancy", "lazy", "--frc", "all"], "--frc all with --redundancy lazy: only eager", 2),
    (["--stages", "2", "--sync-bucket-mb", "0"], "--sync-bucket-mb must be a positive number of MB (got 0.0)", 2),
    (["--stages", "2", "--replica-sync", "next", "--check-replicas"], "--replica-sync next does not run with "
     "--check-replicas yet", 2),
    (["--stages", "2", "--replica-sync", "next", "--local-nodes", "2"], "with agents needs --checkpoint", 2),
    # a run's first iteration owes no sync: node 1's stream is 24 instructions there, 27 after
    (["--stages", "2", "--replica-sync", "next", "--preempt", "1@0:29"], "node 1 runs 28 instructions", 2),
    (["--stages", "2", "--sync-bucket-mb", "nan", "--redundancy", "off"], "--sync-bucket-mb must be a finite", 2),
    # invalid on their face, refused even where the run would not use them
    (["--lr", "nan"], "--lr must be a finite number (got nan)", 2),
    (["--stages", "2", "--hang-timeout", "inf"], "--hang-timeout must be a finite number (got inf)", 2),
    (["--betas", "nan", "0.9"], "--betas must be a finite number", 2),
    (["--stages", "2", "--straggler-factor", "nan"], "--straggler-factor must be a finite number", 2),
    (["--seed", "-1"], "--seed must be a whole number from 0 to", 2),
    (["--seed", str(2**70)], "--seed must be a whole number from 0 to", 2),
    (["--seq", "0"], "--seq must be at least 1", 2),
    (["--stall-timeout", "0"], "--stall-timeout must be a positive number", 2),
    (["--min-loss-scale", "4", "--initial-loss-scale", "2"], "is above --initial-loss-scale", 2),
    (["--stages", "2", "--job", " "], "--job must not be empty", 2),
    (["--stages", "2", "--local-nodes", "100000"], "--local-nodes must be from 1 to 256", 2),
    (["--stages", "2", "--microbatches", "1000000"], "--microbatches must be at most 100000", 2),
    (["--stages", "2", "--job", "a/b"], "--job 'a/b': a job name is 1 to 63 of a-z", 2),
    (["--stages", "2", "--job", "Big_Job"], "--job 'Big_Job': a job name", 2),
    (["--stages", "2", "--job", "x" * 64], "a job name is 1 to 63", 2),
    (["--stages", "2", "--zones", ",,"], "--zones ',,': expected names", 2),
    (["--stages", "2", "--checkpoint-keep", "2"], "--checkpoint-keep and --resume need --checkpoint", 2),
    (["--stages", "2", "--checkpoint", "/tmp/c", "--checkpoint-keep", "-1"], "--checkpoint-keep must not be", 2),
    (["--stages", "2", "--etcd", "127.0.0.1:1", "--etcd-tls", "/nonexistent"],
     "etcd credentials in '/nonexistent': ca.pem is missing", 2),
    (["--stages", "2", "--save-dir", os.path.abspath(__file__)], "is a file, not a directory", 2),
    (["--stages", "1", "--preempt", "garbage"], "--preempt 'garbage': expected NODE@ITERATION", 2),
    (["--data", os.path.join(os.path.dirname(__file__), "__init__.py")], "--data: ", 2),  # an empty file
])
def test_bad_input_gives_one_line(capsys, args, message, code):
    """bamboo-train's main in this process (no interpreter start per case): the exit
    status and the one line; an exception escaping main fails the test."""
    import signal

    from commands.train.cli import main
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--no-progress", "--iterations", "1", *args])
    finally:
        signal.signal(signal.SIGTERM, handler)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert status == code and len(lines) == 1 and message in lines[0], out.err


def test_a_sync_bucket_size_that_does_nothing_says_so(capsys):
    """--sync-bucket-mb with two pipelines: the sync follows the reduce, whole. The
    run goes on (to fail here only at an etcd that is not there)."""
    from commands.train.cli import main
    status = main(["--no-progress", "--iterations", "1", "--pipelines", "2", "--stages", "2", "--sync-bucket-mb", "1",
                   "--etcd", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert status == 1 and "note: --sync-bucket-mb does nothing in this run" in err and "unreachable" in err


def test_an_etcd_in_the_clear_is_named_and_credentials_are_presented(etcd, capsys, tmp_path):
    """A user's etcd without --etcd-tls: a note that it is used in the clear, once
    it answered; with credentials, they are presented (and an etcd that cannot
    check them refuses); --etcd-tls without --etcd does nothing and says so."""
    from bamboo.control.cluster import Cluster
    from bamboo.control.config import JobConfig
    from bamboo.control.credentials import make_job_credentials
    from bamboo.control.protocol import CONFIG
    from commands.train.cli import main
    Cluster(etcd.endpoint, "taken").put(CONFIG(), JobConfig.of(job="taken"))
    common = ["--no-progress", "--iterations", "1", "--stages", "2"]
    assert main([*common, "--etcd", etcd.endpoint, "--job", "taken"]) == 1  # exists: joined only by --local-nodes
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"bamboo-train: note: etcd at {etcd.endpoint} is used in the clear (no --etcd-tls): anyone "
                      "who reaches it can read and rewrite this job") and "already exists" in err[1]
    tls = make_job_credentials(str(tmp_path / "tls"), "job")
    assert main([*common, "--etcd", "127.0.0.1:1", "--etcd-tls", tls]) == 1
    err = capsys.readouterr().err
    assert "in the clear" not in err and "unreachable or refused these credentials" in err
    from commands.train.cli import etcd_notes
    from commands.train.flags import build_parser
    notes = etcd_notes(build_parser().parse_args(["--stages", "2", "--etcd-tls", tls]))
    assert notes == ["--etcd-tls does nothing in this run: the embedded etcd makes its own credentials"]


def test_flags_a_run_does_not_use_are_named_in_a_note(capsys):
    """--stages 1 runs one process: its redundancy and liveness flags do nothing, and a
    constant schedule never reaches --min-lr; each reason is one note line, and the run
    itself goes on (one iteration of the single-process reference)."""
    from commands.train.cli import main
    status = main(["--no-progress", "--iterations", "1", "--stages", "1", "--redundancy", "lazy", "--hang-timeout",
                   "60", "--min-lr", "0.0001", "--seed", "1", "--seq", "64", "--token-dtype", "uint32"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert status == 0 and len(notes) == 4, notes
    assert "--redundancy, --hang-timeout do nothing in this run: --stages 1 runs one process" in notes[0]
    assert "--min-lr does nothing in this run: a constant --lr-schedule" in notes[1]
    assert "--seq does nothing in this run: the built-in model tiny has its own sequence length" in notes[2]
    assert "--token-dtype does nothing in this run: the data are text or token shards" in notes[3]


def test_share_gpu_without_a_gpu_to_share_says_so(capsys, monkeypatch):
    """--share-gpu matters only when a host has more workers than GPUs: on a host
    without one (this machine, or --devices cpu), or with a GPU for each worker, it
    says it does nothing. The GPU count is the host's own, asked of torch (faked as 4
    here for the second case)."""
    from commands.train.cli import main
    from bamboo.transport import devices
    base = ["--no-progress", "--iterations", "1", "--stages", "2", "--share-gpu", "--etcd", "127.0.0.1:1"]
    monkeypatch.setattr(devices, "host_gpus", lambda: 0)
    assert main(base) == 1
    assert "note: --share-gpu does nothing in this run: the workers compute on the CPU: this host has no GPU" in \
        capsys.readouterr().err
    monkeypatch.setattr(devices, "host_gpus", lambda: 4)
    assert devices.share_note(None, 2) == "2 worker(s) on this host and 4 GPU(s) for them: each has its own"
    assert devices.share_note("0", 2) is None  # two workers on GPU 0: they share
    assert "(--devices cpu)" in devices.share_note("cpu", 2)


def test_flags_a_run_uses_give_no_note(capsys):
    from commands.train.cli import main
    status = main(["--no-progress", "--iterations", "1", "--stages", "2", "--redundancy", "lazy", "--hang-timeout",
                   "60", "--lr-schedule", "cosine", "--min-lr", "0.0001", "--etcd", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert status == 1 and "unreachable" in err and "note:" not in err, err


def test_bad_input_from_a_real_process_is_one_line():
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--iterations", "1",
                          "--model", "math:sqrt"], capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "the factory failed" in lines[0], out.stderr


def test_a_run_that_trained_nothing_leaves_no_metrics_file(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--stages", "2", "--etcd",
                          "127.0.0.1:1", "--metrics-out", str(metrics)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "unreachable" in out.stderr
    assert not metrics.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_channels_of_their_own_keep_the_math(tmp_path, reference, monkeypatch):
    """--transport nccl's path (a group per directed channel, the failover aborting
    the dead node's channels), run on the CPU with gloo groups: a SIGKILL mid-iteration."""
    monkeypatch.setenv("BAMBOO_CHANNELS_ON_CPU", "1")
    _, records, params = train(tmp_path, "channels", "--stages", str(P), "--pipelines", str(D),
                               "--preempt", kill_point(0, _backward_of_first_stage))
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}


@pytest.mark.slow  # make test-slow: keeps make test under 15 min (factories: test_models.py)
def test_factory_sequential_on_two_stages_survives_losing_one(tmp_path):
    """P=2: the survivor is predecessor and successor at once and ends up running
    the whole model; a user nn.Sequential named as package.module:function."""
    args = ["--model", "tests.sample_models:byte_mlp", "--microbatches", "4", "--iterations", "6", "--seed", "1",
            "--dtype", "float64"]

    def run(name, *extra):
        return bamboo_train(tmp_path / f"{name}.jsonl", *args, *extra)[1]

    ref = run("ref", "--stages", "1")
    got = run("kill", "--stages", "2", "--preempt", "1@2:7")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=RTOL)
    assert [r["nodes"] for r in got] == [2, 2, 1, 1, 1, 1]


@pytest.mark.slow
def test_two_failures_in_one_pipeline_and_iteration_end_with_a_reason(tmp_path):
    out, _, _ = train(tmp_path, "double", "--stages", "4", "--pipelines", "1", "--iterations", "4",
                      "--preempt", "1@2:6", "--preempt", "2@2:6", check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    # Seen in one poll, in the cut of the first, or as neighbours: each names the reason.
    assert any(why in lines[0] for why in ("one failure per pipeline per iteration", "adjacent",
                                           "died while it recovered from node"))


def test_ctrl_c_stops_every_process_it_started(tmp_path):
    import signal
    import time

    import psutil
    checkpoints = tmp_path / "ckpt"  # its first files say that training is under way
    proc = subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--stages", "2", "--iterations", "100000",
                             "--no-progress", "--metrics-out", str(tmp_path / "m.jsonl"), "--checkpoint",
                             str(checkpoints), "--checkpoint-every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    try:
        while len(parent.children(recursive=True)) < 3 and time.monotonic() < deadline:  # etcd + 2 workers
            time.sleep(0.2)
        children = parent.children(recursive=True)
        assert len(children) >= 3
        while not (checkpoints.exists() and any(checkpoints.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.1)  # interrupted while it trains: after its first iteration's checkpoint began
        assert checkpoints.exists() and any(checkpoints.iterdir()), "training never got past its first iteration"
    finally:
        proc.send_signal(signal.SIGINT)  # a failed wait too: a job of 100000 iterations must not outlive the test
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def _short(tmp_path, name, *args):
    return bamboo_train(tmp_path / f"{name}.jsonl", "--microbatches", "8", "--iterations", "5", "--dtype", "float64",
                        *args)[1]


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
@pytest.mark.parametrize("where", ["before-its-loss-write", "after-its-stream"])
def test_last_stage_killed_after_its_stream_keeps_every_loss(tmp_path, where):
    """The last stage finishes first and lingers: dying then must lose nothing. It
    writes its losses just before it waits for its replica's sync: killed there,
    its losses exist only where they travelled, with its gradients."""
    stream = compile_schedule(4, 8).streams[3]
    end = len(stream) if where == "after-its-stream" else next(i for i, x in enumerate(stream) if x.op is Op.RECV_SYNC)
    ref = _short(tmp_path, "ref", "--stages", "1")
    got = _short(tmp_path, "kill", "--stages", "4", "--preempt", f"3@2:{end}")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=RTOL)
    assert [r["nodes"] for r in got] == [4, 4, 3, 3, 3]


@pytest.mark.slow
def test_a_paused_node_is_declared_dead_and_fences_itself(tmp_path):
    """SIGSTOP past the lease: the pipeline goes on without the node while it is
    still stopped (its predecessor gives up a send the node will never take); when
    it wakes up it finds itself dead and stops instead of corrupting the job."""
    import signal
    import time

    import psutil

    from bamboo.control.etcd import EtcdServer, connect
    from bamboo.control.protocol import DONE, scan
    metrics = tmp_path / "m.jsonl"

    def finished(client, it):
        return any(family is DONE and parts[0] == it for _, family, parts in scan(client))
    with EtcdServer() as etcd:
        proc = subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--stages", "4", "--microbatches", "6",
                                 "--iterations", "40", "--no-progress", "--failure-timeout", "2",
                                 "--etcd", etcd.endpoint, "--metrics-out", str(metrics)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client = connect(etcd.endpoint)
        deadline = time.monotonic() + 120
        while not finished(client, 3):  # training runs
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        worker = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                      if p.cmdline()[-2:] == ["--node", "1"])
        worker.send_signal(signal.SIGSTOP)
        stopped_at = max(it for _, family, (it, _) in ((j, f, p) for j, f, p in scan(client) if f is DONE))
        deadline = time.monotonic() + 90
        while not finished(client, stopped_at + 3):  # three more iterations while it is stopped
            assert time.monotonic() < deadline and proc.poll() is None, "no progress while a node is stopped"
            time.sleep(0.1)
        worker.send_signal(signal.SIGCONT)
        gone, _ = psutil.wait_procs([worker], timeout=20)
        assert gone and proc.poll() in (None, 0)  # the woken node stopped; the job goes on (or just ended well)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # The pause lands inside an iteration (a failover) or between two (the barrier
    # records the death): either way the job finishes on the three others.
    assert records[-1]["summary"]["failovers"] <= 1 and records[-2]["nodes"] == 3


@pytest.mark.slow
def test_a_survivor_called_away_from_its_reduce_resends_before_it_waits_there_again(tmp_path, reference):
    """P=3, D=2, no agents. Node 1 dies in iteration 2, so from then on node 0 runs
    stages 0 and 1 and reduces stage 0 before stage 1. Node 3 dies in iteration 5
    just before its reduce: node 5 takes stage 0 over and needs node 4's kept
    gradients, while node 4 waits in stage 1's reduce for node 0, which waits in
    stage 0's reduce for node 5. Node 4 must re-send before it waits there again
    (the 300 s pause of bamboo-chaos --network seed 20 was this cycle); the job
    ends well inside its hang timeout and equals the reference."""
    streams = compile_schedule(3, M // 2, (), options=ScheduleOptions(redundancy="eager")).streams
    before_reduce = {n: next(i for i, x in enumerate(streams[n]) if x.op is Op.REDUCE_GRADS) for n in (0, 1)}
    _, records, params = train(tmp_path, "cycle", "--stages", "3", "--pipelines", "2", "--hang-timeout", "60",
                               "--preempt", f"1@2:{before_reduce[1]}", "--preempt", f"3@5:{before_reduce[0]}")
    assert_same_training(records, params, reference)
    assert [r["nodes"] for r in records] == [6] * 2 + [5] * 3 + [4] * (ITERS - 5)
    assert max(r["seconds"] for r in records) < 55  # a cycle waits out the 60 s hang timeout


@pytest.mark.slow
def test_eager_places_frc_by_measured_times_and_keeps_the_math(tmp_path, reference):
    """A real eager job (P=4, one pipeline): from the epoch's calibration on, the
    streams are the measured model's; a SIGKILL then is recovered from, and every
    loss and parameter equals the single-process reference."""
    logs = tmp_path / "logs"
    _, records, params = train(tmp_path, "measured", "--stages", "4", "--pipelines", "1", "--preempt", "2@5:0",
                               "--check-replicas", "--log-dir", str(logs))
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}
    said = [line for f in logs.iterdir() for line in f.read_text().splitlines() if "measured op times" in line]
    assert len(said) == 4 and all("from iteration 4 FRC is placed" in line for line in said), said


def _last_but_one(node: int) -> int:
    """Where `node`'s compute-ahead stream (lazy, P=4, D=2) has sent its sync and stepped:
    before its replica's step, its last instruction."""
    options = ScheduleOptions(redundancy="lazy", ahead=True)
    return len(compile_schedule(P, M // D, (), options=options).streams[node]) - 1


@pytest.mark.slow  # make test-slow: --compute-ahead is opt-in; keeps make test under 15 minutes
@pytest.mark.parametrize("at", ["early", "after its step"])
def test_stage_0_runs_the_next_forward_while_the_boundary_agrees(tmp_path, reference, at):
    """--compute-ahead (bamboo/runtime/ahead.py), lazy, P=4, D=2: each pipeline's stage-0
    owner begins every iteration after the first with the forwards it ran while the
    boundary agreed, also when node 1's death in iteration 5 merged stages 0 and 1
    on node 0: early in the iteration, or once node 1 has stepped, when node 0 may
    have begun its next forwards and recovers meanwhile (they are dropped first: a
    recovery's forwards draw dropout from the generator they seed). Every loss and
    parameter equals the single-process reference."""
    logs = tmp_path / "logs"
    kill = f"1@5:{3 if at == 'early' else _last_but_one(1)}"
    _, records, params = train(tmp_path, "ahead", "--stages", str(P), "--pipelines", str(D), "--redundancy", "lazy",
                               "--preempt", kill, "--log-dir", str(logs), "--compute-ahead")
    assert_same_training(records, params, reference)
    said = {f.name: line for f in logs.iterdir() for line in f.read_text().splitlines() if "run while the" in line}
    assert len(said) == 2 and all(f"{ITERS - 1} iterations began" in line for line in said.values()), said


@pytest.mark.slow
def test_a_sync_in_buckets_cut_by_its_owners_death_keeps_the_math(tmp_path, reference):
    """Lazy, P=4, one pipeline, buckets of 10 KB (a stage of `tiny` in float64 is
    several): every iteration's syncs go out in buckets during the stages' last
    backwards (bamboo/runtime/sync.py). Node 2 dies just before its SEND_SYNC in
    iteration 5, its buckets but the last with node 1: the holder drops the parts,
    recomputes the stage as if it had no sync, and the job equals the reference."""
    stream = compile_schedule(P, M, (), options=ScheduleOptions(redundancy="lazy")).streams[2]
    at = next(i for i, x in enumerate(stream) if x.op is Op.SEND_SYNC)
    _, records, params = train(tmp_path, "buckets", "--stages", str(P), "--pipelines", "1", "--redundancy", "lazy",
                               "--sync-bucket-mb", "0.01", "--preempt", f"2@5:{at}")
    assert_same_training(records, params, reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}


@pytest.mark.slow
def test_a_sync_in_the_next_iteration_keeps_the_math_through_a_death_after_it_landed(tmp_path):
    """--replica-sync next (schedules/syncs.py), eager, P=4, one pipeline: each
    replica takes its owner's gradients of iteration i during iteration i+1, and
    steps with i's rate. Node 2 dies in iteration 5 at its first backward, after its
    sync of iteration 4 reached node 1: node 1 takes that sync first, then the
    stage, and the job equals the reference (a replica a step behind would not)."""
    stream = compile_schedule(P, M, (), options=ScheduleOptions(redundancy="eager", sync="next")).streams[2]
    assert stream[0].op is Op.SEND_SYNC
    at = next(i for i, x in enumerate(stream) if x.op in INPUT_GRADS)
    schedule = ["--lr-schedule", "cosine", "--warmup", "3"]  # every iteration its own rate
    _, records, params = train(tmp_path, "late", "--stages", str(P), "--pipelines", "1", "--replica-sync", "next",
                               "--preempt", f"2@5:{at}", *schedule)
    _, *own_reference = train(tmp_path, "late-reference", "--stages", "1", "--pipelines", "1", *schedule)
    assert_same_training(records, params, own_reference)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}


@pytest.mark.slow
def test_a_late_sync_keeps_clipping_and_tied_weights_through_a_death(tmp_path):
    """--replica-sync next with --grad-clip and a model with tied weights (hf:gpt2-tiny:
    the embedding on stage 0 and the head on stage 3): the late sync carries gradients
    tied and clipped at the owner's step, and is not held back to this iteration's
    step phase. Node 0, owner of a tied copy, dies in iteration 5 after its sync
    landed: the job equals the single-process reference, whose clipping bites."""
    stream = compile_schedule(P, M, (), options=ScheduleOptions(redundancy="eager", sync="next")).streams[0]
    at = next(i for i, x in enumerate(stream) if x.op is Op.BACKWARD)
    model = ["--model", "hf:gpt2-tiny", "--lr-schedule", "cosine", "--warmup", "3"]
    _, records, params = train(tmp_path, "late-clip", "--stages", str(P), "--pipelines", "1", *model,
                               "--grad-clip", "0.05", "--replica-sync", "next", "--preempt", f"0@5:{at}")
    _, reference, ref_params = train(tmp_path, "late-clip-reference", "--stages", "1", *model, "--grad-clip", "0.05")
    _, unclipped, _ = train(tmp_path, "late-unclipped", "--stages", "1", *model)
    assert {"preemption", "failover"} == {e["type"] for e in records[5]["events"]}
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], rel=RTOL)
    assert [r["loss"] for r in unclipped] != pytest.approx([r["loss"] for r in reference], rel=RTOL)
    for f in sorted(os.listdir(ref_params)):
        a, b = torch.load(ref_params / f), torch.load(params / f)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=1e-9)


@pytest.mark.slow  # make test-slow: the refusal itself is tests/unit/schedules/test_late_sync.py's, in make test
def test_a_death_before_its_late_sync_landed_ends_the_job_with_its_reason(tmp_path):
    """The same with node 2 killed before its first instruction of iteration 5, the
    sync of iteration 4: node 1's replica is a step behind, which no recovery in the
    iteration mends, and without agents the job ends saying so."""
    out, records, _ = train(tmp_path, "late-window", "--stages", str(P), "--pipelines", "1", "--redundancy", "lazy",
                            "--replica-sync", "next", "--iterations", "6", "--preempt", "2@5:0", check=False)
    assert out.returncode != 0 and "a step behind (--replica-sync next)" in out.stderr, out.stderr
    assert [r["iteration"] for r in records] == list(range(5))


def test_a_death_between_iterations_with_a_sync_owed_is_unsurvivable():
    """A node recorded dead at a boundary, not in the iteration before: it took its
    sync of that iteration with it (bamboo/runtime/failover.py _check_owed)."""
    from bamboo.runtime.failover import Failover, Unsurvivable
    from bamboo.runtime.watch import Watch
    failover = Failover(None, (10, 11, 12, 13), 0, 0, ScheduleOptions(redundancy="lazy", sync="next"), JobConfig())
    failover.now = Watch(4, 8, (), None, {})
    failover._check_owed(5, (), owed=True)  # nobody new: nothing said
    failover._check_owed(5, (2,), owed=False)  # a first iteration owes nothing
    with pytest.raises(Unsurvivable, match="node 12 died between iterations before its sync of iteration 4 "
                                           "reached node 11"):
        failover._check_owed(5, (2,), owed=True)
    failover.now = Watch(5, 8, (2,), None, {})  # died during iteration 5 and recovered there: covered
    failover._check_owed(6, (2,), owed=True)


def test_replica_sync_next_with_redundancy_off_is_the_sync_at_the_end():
    """--redundancy off keeps no replica: --replica-sync next (said to do nothing)
    must not make a death between iterations unsurvivable, which agents redo."""
    from bamboo.runtime.failover import Failover
    from bamboo.runtime.watch import Watch
    failover = Failover(None, (10, 11, 12, 13), 0, 0, ScheduleOptions(redundancy="off", sync="next"),
                        JobConfig.of(elastic=True))
    failover.now = Watch(4, 8, (), None, {})
    failover._check_owed(5, (2,), owed=True)
    assert failover.sync == "end"
