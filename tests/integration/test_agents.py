"""Elastic agents end to end: real agents (torch elastic), real workers, a real etcd,
real SIGKILL and SIGTERM. Each run is compared with the single-process reference on
the same samples (float64): per-iteration losses, and final parameters, equal
through failovers, reconfigurations, joins and an etcd restart.
"""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from bamboo.control.etcd import EtcdServer, connect
from bamboo.control.protocol import ASSIGNMENT, DONE, REGROUP, scan
from tests.training import bamboo_train, redos

ITERS = 30
LONG = 200  # a job that must outlast newcomers started from outside it
COMMON = ["--model", "tiny", "--stages", "2", "--iterations", str(ITERS), "--seed", "5", "--dtype", "float64",
          "--check-replicas"]
RTOL = 1e-5
_references: dict = {}


def reference(tmp_path_factory, microbatches: int, iterations: int = ITERS):
    if (microbatches, iterations) not in _references:
        tmp = tmp_path_factory.mktemp(f"reference{microbatches}-{iterations}")
        _, records = bamboo_train(tmp / "m.jsonl", *COMMON, "--stages", "1", "--microbatches", str(microbatches),
                                  "--iterations", str(iterations), "--save-dir", str(tmp / "params"))
        _references[microbatches, iterations] = records, tmp / "params"
    return _references[microbatches, iterations]


def train(tmp_path, *args):
    """The agents' job, every node kept (--surplus keep): these tests are about the
    standby (test_release.py, the release of what the burst rule does not keep)."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--save-dir", str(tmp_path / "params"),
                              "--surplus", "keep", *args)
    return records


def assert_same_training(records, tmp_path, ref):
    ref_records, ref_params = ref
    assert [r["iteration"] for r in records] == list(range(len(ref_records)))
    for got, want in zip(records, ref_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"iteration {got['iteration']}"
        assert got["replicas_equal"], f"iteration {got['iteration']}: copies of a stage differ"
    for f in sorted(os.listdir(ref_params)):
        a, b = torch.load(ref_params / f), torch.load(tmp_path / "params" / f)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=1e-9)


def reconfigurations(records) -> list[tuple[int, dict]]:
    return [(r["iteration"], e) for r in records for e in r["events"] if e["type"] == "reconfigure"]


@pytest.mark.slow
def test_a_killed_node_is_replaced_from_standby(tmp_path, tmp_path_factory):
    """3 nodes, P=2: one pipeline and one node in standby. Node 1 (agent and worker)
    is SIGKILLed mid-iteration: its predecessor takes over, and at the next boundary
    the standby node gets the stage and the replicas are whole again."""
    records = train(tmp_path, "--microbatches", "4", "--local-nodes", "3", "--zones", "a,b", "--preempt", "1@4:5",
                    "--max-stages-per-node", "1")
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))
    (it0, first), (it1, second) = reconfigurations(records)
    assert it0 == 0 and first["standby"] == [2] and 1 in first["pipelines"][0]
    assert it1 == 5 and second["standby"] == [] and sorted(second["pipelines"][0]) == [0, 2]
    assert [e["type"] for e in records[4]["events"]].count("failover") == 1
    assert records[4]["nodes"] == 1 and records[5]["nodes"] == 2


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_a_pipeline_dissolves_when_nodes_run_short(tmp_path, tmp_path_factory):
    """4 nodes, P=2, D=2; one is killed: 3 nodes make one pipeline and a spare, so
    D drops to 1 and the layers of the dissolved pipeline's survivor move to where
    they are needed. The math does not notice."""
    records = train(tmp_path, "--microbatches", "4", "--local-nodes", "4", "--zones", "a,b", "--preempt", "3@6:2",
                    "--max-stages-per-node", "1")
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))
    (_, first), (it, second) = reconfigurations(records)
    assert len(first["pipelines"]) == 2 and it == 7
    assert len(second["pipelines"]) == 1 and len(second["standby"]) == 1 and 3 not in second["standby"]


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_joining_nodes_wait_in_standby_then_form_a_pipeline(tmp_path, tmp_path_factory):
    records = train(tmp_path, "--microbatches", "8", "--local-nodes", "3", "--zones", "a,b,c", "--join", "1@1",
                    "--max-stages-per-node", "1")
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 8))
    changes = reconfigurations(records)
    assert changes[0][1]["standby"] == [2] and len(changes[0][1]["pipelines"]) == 1
    assert len(changes[-1][1]["pipelines"]) == 2 and changes[-1][1]["standby"] == []
    assert records[-1]["nodes"] == 4
    for _, change in changes:  # neighbours (cyclically) in different zones wherever zones allow
        for pipe in change["pipelines"]:
            zones = ["abc"[n % 3] for n in pipe]
            assert zones[0] != zones[1]


@pytest.mark.slow  # make test stays under 15 min on a 2-core machine
def test_a_node_still_to_join_does_not_keep_a_dead_job_waiting(tmp_path):
    """--join starts the joining agents at launch, waiting for their iteration; when
    every node of the job dies before it, the launcher says so at once instead of
    waiting out --stall-timeout for a joiner that will never be asked in."""
    out, _ = bamboo_train(tmp_path / "m.jsonl", "--model", "tiny", "--stages", "2", "--microbatches", "4",
                          "--iterations", "10", "--local-nodes", "2", "--zones", "a,b", "--preempt", "0@3:3",
                          "--preempt", "1@3:3", "--join", "1@6", check=False, timeout=240)
    assert out.returncode == 1 and "every worker exited while waiting for iteration 3" in out.stderr, out.stderr


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_growth_beyond_the_microbatch_count_leaves_the_extra_nodes_in_standby(tmp_path, tmp_path_factory):
    """From outside: two microbatches and six nodes at P=2. A third
    pipeline would have no microbatch to run (it once crashed the job)."""
    records = train(tmp_path, "--microbatches", "2", "--local-nodes", "2", "--zones", "a,b", "--join", "4@1")
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 2))
    last = reconfigurations(records)[-1][1]
    assert len(last["pipelines"]) == 2 and len(last["standby"]) == 2


def final(records):
    """The last record of each iteration (a redone iteration appears twice)."""
    return list({r["iteration"]: r for r in records}.values())


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_adjacent_failures_recovered_from_the_other_pipeline(tmp_path, tmp_path_factory):
    """Both nodes of pipeline 0 die in one iteration: no copy of their stages is left
    in that pipeline. Every node undoes the iteration's steps, the survivors of
    pipeline 1 redo it alone, and no checkpoint is involved (none is configured)."""
    records = train(tmp_path, "--microbatches", "4", "--local-nodes", "4", "--zones", "a,b",
                    "--preempt", "0@6:3", "--preempt", "1@6:3")
    assert [r["iteration"] for r in records] == list(range(ITERS))  # nothing repeated in the metrics
    redo = redos(records)
    assert redo == [{"type": "redo", "abandoned": 6, "from": 6, "restore": "peers"}]
    assert records[6]["nodes"] == 2
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))


@pytest.mark.slow  # make test stays under 15 min on a 2-core machine
def test_a_stage_lost_everywhere_restarts_from_the_checkpoint(tmp_path, tmp_path_factory):
    """One pipeline (P=3) and two spares; two neighbours die in iteration 9: the
    stage they held is gone, so the job goes back to the checkpoint taken before
    iteration 8 and loses only iteration 8."""
    records = train(tmp_path, "--stages", "3", "--microbatches", "4", "--local-nodes", "5", "--zones", "a,b,c",
                    "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
                    "--preempt", "1@9:2", "--preempt", "2@9:2", "--max-stages-per-node", "1")
    assert [r["iteration"] for r in records] == list(range(9)) + list(range(8, ITERS))
    redo = redos(records)
    assert redo == [{"type": "redo", "abandoned": 9, "from": 8, "restore": "checkpoint"}]
    assert records[8]["loss"] == records[9]["loss"]  # the redone iteration computes the same
    assert_same_training(final(records), tmp_path, reference(tmp_path_factory, 4))


@pytest.mark.slow  # make test-slow: the race it guards is timing-dependent here; chaos --network seed 23 hit it
def test_newcomers_still_starting_join_a_restart_from_the_checkpoint(tmp_path, tmp_path_factory):
    """One pipeline (P=3), no spare; two neighbours die in iteration 9 while two
    new nodes join: the job restarts from storage with them. Their workers may not
    have registered when the survivor forms the epoch's world: they count as alive
    while their agents are, never recorded dead (chaos seed 23 stalled on this)."""
    records = train(tmp_path, "--stages", "3", "--microbatches", "4", "--local-nodes", "3", "--zones", "a,b,c",
                    "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--join", "2@8",
                    "--preempt", "1@9:2", "--preempt", "2@9:2", "--max-stages-per-node", "1")
    last = reconfigurations(records)[-1][1]
    assert sorted(last["pipelines"][0]) == [0, 3, 4], f"the newcomers did not train: {last}"  # none came back anew
    assert_same_training(final(records), tmp_path, reference(tmp_path_factory, 4))


@pytest.mark.slow  # make test-slow: four agents, a checkpoint and a restart (chaos seed 34 found it)
def test_every_member_gone_at_once_is_redone_by_the_standbys(tmp_path, tmp_path_factory):
    """One pipeline (P=2) and two standbys that joined after iteration 5; both
    members die at the start of iteration 6, before either could abort or
    regroup (only workers write those). The standbys' agents record them dead and
    redo from the checkpoint before iteration 4 (chaos seed 34 waited out its
    600 s stall timeout here)."""
    records = train(tmp_path, "--stages", "2", "--microbatches", "4", "--local-nodes", "2", "--join", "2@5",
                    "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
                    "--preempt", "0@6:0", "--preempt", "1@6:0")
    redo = redos(records)
    assert redo == [{"type": "redo", "abandoned": 6, "from": 4, "restore": "checkpoint"}]
    assert sorted(reconfigurations(records)[-1][1]["pipelines"][0]) == [2, 3]
    assert_same_training(final(records), tmp_path, reference(tmp_path_factory, 4))


def _launch(tmp_path, etcd, *args):
    return subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd", etcd.endpoint,
                             "--metrics-out", str(tmp_path / "m.jsonl"), "--save-dir", str(tmp_path / "params"),
                             *COMMON, "--surplus", "keep", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_iteration(etcd, it: int, proc) -> None:
    client = connect(etcd.endpoint)
    deadline = time.monotonic() + 120
    while not any(family is DONE and parts[0] == it for _, family, parts in scan(client)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
        time.sleep(0.05)
    client.close()


def _records(tmp_path):
    return [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if "summary" not in r]


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_a_drained_node_hands_its_stage_over(tmp_path, tmp_path_factory):
    """SIGTERM to an agent (what a preemption notice does): the node leaves at the
    next boundary after handing its layers over; nobody counts it as failed."""
    with EtcdServer() as etcd:
        proc = _launch(tmp_path, etcd, "--microbatches", "4", "--local-nodes", "3", "--zones", "a,b",
                       "--max-stages-per-node", "1")
        _wait_for_iteration(etcd, 3, proc)
        agent = next(p for p in psutil.Process(proc.pid).children()
                     if "agents.agent" in p.cmdline() and p.cmdline()[p.cmdline().index("--node") + 1] == "1")
        agent.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert not agent.is_running()  # the drained agent left (the launcher checked its exit status)
    records = _records(tmp_path)
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))
    last = reconfigurations(records)[-1][1]
    assert 1 not in last["pipelines"][0] and sorted(last["pipelines"][0]) == [0, 2]
    assert not any(e["type"] == "failover" for r in records for e in r["events"])


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_a_second_launcher_joins_a_running_job(tmp_path, tmp_path_factory):
    """`bamboo-train --etcd HOST:PORT --job NAME --local-nodes 2` on a running job
    adds two nodes to it: they form a second pipeline. The job runs long enough
    (LONG iterations of the tiny model) for the newcomers to start on an idle
    machine: they import torch after the launcher has returned."""
    with EtcdServer() as etcd:
        first = _launch(tmp_path, etcd, "--microbatches", "8", "--local-nodes", "2", "--zones", "a,b",
                        "--job", "shared", "--iterations", str(LONG))
        _wait_for_iteration(etcd, 1, first)
        second = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd", etcd.endpoint,
                                 "--job", "shared", "--local-nodes", "2", "--zones", "c"],
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        assert json.loads(second.stdout) == {"joined": "shared", "nodes": 2}
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-2000:]
    records = _records(tmp_path)
    assert records[0]["nodes"] == 2 and records[-1]["nodes"] == 4
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 8, LONG))


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_etcd_restart_mid_run(tmp_path, tmp_path_factory):
    """etcd SIGKILLed and restarted on the same data dir: agents and workers
    reconnect, every iteration is agreed once, training continues unchanged."""
    with EtcdServer() as etcd:
        proc = _launch(tmp_path, etcd, "--microbatches", "4", "--local-nodes", "3", "--zones", "a,b")
        _wait_for_iteration(etcd, 4, proc)
        etcd.kill()
        time.sleep(1.5)
        etcd.start()
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        client = connect(etcd.endpoint)
        keys = scan(client)
    assert sorted(parts for _, family, parts in keys if family is REGROUP) == sorted(
        (it, 0) for it in range(ITERS))  # one decision per iteration boundary, none twice
    assert [parts for _, family, parts in keys if family is ASSIGNMENT] == [0]
    assert_same_training(_records(tmp_path), tmp_path, reference(tmp_path_factory, 4))
