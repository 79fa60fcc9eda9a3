"""Start-up with fewer nodes than asked: agents SIGKILLed from outside in the
first seconds, each kill synchronised on an event (its registration in etcd, or its
process appearing). With a pipeline's worth alive, the first configuration starts with
them after the last call, and trains exactly as the single-process reference
(float64); with fewer, the job ends at once with one line naming the missing nodes.
"""
import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

import agents.agent
from commands.train import cli
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.etcd import EtcdServer, connect
from bamboo.control.protocol import ASSIGNMENT, CONFIG, MEMBERS, scan
from tests.training import bamboo_train

ITERS = 6
COMMON = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--iterations", str(ITERS), "--seed", "5",
          "--dtype", "float64"]


def _launch(tmp_path, etcd, *args):
    return subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd", etcd.endpoint,
                             "--metrics-out", str(tmp_path / "m.jsonl"), *COMMON, "--surplus", "keep", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _agent(proc, node: int):
    """The agent process of `node` among the launcher's children, or None (not started yet)."""
    for child in psutil.Process(proc.pid).children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "agents.agent" in cmd and cmd[cmd.index("--node") + 1] == str(node):
            return child
    return None


def _kill_on(proc, etcd, nodes, registered: bool) -> bool:
    """SIGKILL the agents of `nodes`, each as soon as it registered in etcd (`registered`)
    or its process exists; True if assignment 0 did not exist yet at the last kill."""
    client = connect(etcd.endpoint)
    left, deadline, first = set(nodes), time.monotonic() + 120, True
    while left:
        assert time.monotonic() < deadline and proc.poll() is None, "the launcher ended before the kills"
        keys = scan(client) if registered else []
        members = {parts for _, family, parts in keys if family is MEMBERS}
        first = not any(family is ASSIGNMENT for _, family, _ in keys)
        for n in sorted(left):
            agent = _agent(proc, n)
            if agent is not None and (not registered or n in members):
                agent.send_signal(signal.SIGKILL)
                left.discard(n)
        time.sleep(0.02)
    client.close()
    return first


def _same_as_reference(metrics, want: list[dict]) -> list[dict]:
    """The job's iteration records, checked whole and equal to the reference's losses."""
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "summary" not in r]
    assert [r["iteration"] for r in records] == list(range(ITERS))
    for got, ref in zip(records, want):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), got["iteration"]
    return records


@pytest.mark.slow  # about a minute on a loaded 2-core machine
def test_nodes_killed_during_start_up_leave_the_rest_to_train(tmp_path):
    """Six nodes asked for at P=2; three are SIGKILLed once registered, before the first
    configuration: after the last call the three others train, as the reference does."""
    _, want = bamboo_train(tmp_path / "ref.jsonl", *COMMON, "--stages", "1")
    with EtcdServer() as etcd:
        proc = _launch(tmp_path, etcd, "--local-nodes", "6", "--zones", "a,b,c", "--last-call", "3")
        before = _kill_on(proc, etcd, (3, 4, 5), registered=True)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    records = _same_as_reference(tmp_path / "m.jsonl", want)
    assert before and records[-1]["nodes"] == 3, (before, records[-1])
    first = [e for r in records for e in r["events"] if e["type"] == "reconfigure"][0]
    assert {n for p in first["pipelines"] for n in p} <= {0, 1, 2}  # epoch 0: only the live nodes


@pytest.mark.slow  # about a minute on a loaded 2-core machine
def test_a_node_killed_once_assignment_0_names_it_is_an_ordinary_failure(tmp_path):
    """Four nodes at P=2: node 1, in epoch 0, is SIGKILLed (agent and worker) as soon as
    assignment 0 exists, before the first iteration: the workers abandon the epoch,
    the agents configure the survivors, and the math is the reference's."""
    _, want = bamboo_train(tmp_path / "ref.jsonl", *COMMON, "--stages", "1")
    with EtcdServer() as etcd:
        proc = _launch(tmp_path, etcd, "--local-nodes", "4", "--zones", "a,b", "--max-stages-per-node", "1")
        client = connect(etcd.endpoint)
        deadline = time.monotonic() + 120
        while not any(family is ASSIGNMENT for _, family, _ in scan(client)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        client.close()
        agent = _agent(proc, 1)
        for p in [agent, *agent.children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    records = _same_as_reference(tmp_path / "m.jsonl", want)
    assert records[-1]["nodes"] == 2  # one pipeline of the three left, the third in standby


def test_too_few_nodes_to_start_end_the_job_naming_the_missing(tmp_path):
    """Three nodes asked for at P=2, one stage per node; two are SIGKILLed as soon as their
    processes exist: the one left cannot make a pipeline, so the launcher says which
    nodes are missing and exits 1 at once (no traceback, no wait for any timeout)."""
    with EtcdServer() as etcd:
        proc = _launch(tmp_path, etcd, "--local-nodes", "3", "--zones", "a,b", "--max-stages-per-node", "1")
        _kill_on(proc, etcd, (1, 2), registered=False)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
    assert time.monotonic() - killed < 30
    assert proc.returncode == 1
    lines = [line for line in err.strip().splitlines() if not line.startswith("bamboo-train: note: etcd at ")]
    assert len(lines) == 1 and lines[0].startswith("bamboo-train: error: only 1 of 3 nodes started "
                                                   "(missing: 1 (b), 2 (a)); a pipeline of 2 stages needs 2"), err


def test_an_agent_alone_gives_up_at_its_start_timeout(tmp_path):
    """bamboo-agent with nobody to meet: one line after --start-timeout, status 1."""
    with EtcdServer() as etcd:
        cluster = Cluster(etcd.endpoint, "alone")
        cluster.put(CONFIG(), JobConfig.of(stages=2, max_stages_per_node=1, elastic=True, job="alone"))
        out = subprocess.run([sys.executable, "-m", "agents.agent", "--etcd", etcd.endpoint, "--job", "alone",
                              "--zone", "a", "--start-timeout", "1"], capture_output=True, text=True, timeout=120)
        cluster.close()
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == ["bamboo-agent: error: no first configuration within --start-timeout 1 s: only 1 nodes are "
                     "registered and alive (0); a pipeline needs 2"], out.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_last_call_is_refused_in_one_line(value, capsys):
    """Both commands' own mains, in this process: refused before etcd is asked."""
    with pytest.raises(SystemExit) as agent:
        agents.agent.main(["--etcd", "127.0.0.1:1", "--job", "j", "--zone", "a", f"--last-call={value}"])
    said = capsys.readouterr().err
    train = cli.main(["--local-nodes", "2", f"--last-call={value}"])
    for code, err in ((agent.value.code, said), (train, capsys.readouterr().err)):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "--last-call" in lines[0], err
