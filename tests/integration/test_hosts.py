"""Machines of several workers (`bamboo-agent --workers N`, `bamboo-train
--local-hosts H --workers-per-host N`): the flags' checks, and a whole machine
SIGKILLed from outside under a real job, compared with the single-process
reference (float64)."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from agents.host import agent_argv
from commands.train import cli
from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdServer, connect
from bamboo.control.protocol import ASSIGNMENT, DONE, FAILED, HOST_LOST, ZONES, scan
from tests.training import bamboo_train

ITERS = 12
COMMON = ["--model", "tiny", "--stages", "4", "--microbatches", "8", "--iterations", str(ITERS), "--seed", "5",
          "--dtype", "float64", "--max-stages-per-node", "1"]


@pytest.mark.parametrize("flags, says", [
    (["--local-hosts", "2", "--local-nodes", "4"], "--local-hosts with --local-nodes"),
    (["--local-hosts", "2", "--workers-per-host", "0"], "both must be at least 1"),
    (["--workers-per-host", "2"], "--workers-per-host needs --local-hosts"),
    (["--local-hosts", "1", "--workers-per-host", "2"], "fewer than --stages 4"),
    (["--local-hosts", "2", "--join", "2@3"], "--join with --local-hosts"),
])
def test_bad_host_flags_give_one_line(flags, says, capsys):
    """bamboo-train's own main, in this process: refused before anything starts."""
    assert cli.main([*COMMON, *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_machines_agents_get_its_name_and_consecutive_ids():
    argv = ["--etcd", "e:1", "--workers", "2", "--node", "4", "--job", "j", "--host=old", "--zone", "a"]
    assert agent_argv(argv, "m1", 5) == ["--etcd", "e:1", "--job", "j", "--zone", "a", "--host", "m1", "--node", "5"]
    assert agent_argv(["--workers=2", "--zone", "a"], "m1", None) == ["--zone", "a", "--host", "m1"]
    out = subprocess.run([sys.executable, "-m", "agents.agent", "--etcd", "e:1", "--job", "j", "--zone", "a",
                          "--workers", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--workers must be at least 1" in out.stderr


def _wait_for_iteration(client, it: int, proc) -> None:
    deadline = time.monotonic() + 240
    while not any(family is DONE and parts[0] == it for _, family, parts in scan(client)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
        time.sleep(0.05)


@pytest.mark.slow  # about a minute and a half on a loaded 2-core machine
def test_a_whole_machine_killed_is_one_event(tmp_path):
    """Three machines of two workers, P=4: one pipeline, two nodes in standby. The
    machine with a node in the pipeline and one in standby is SIGKILLed (its
    agent process: both agents and workers die with it). The pipeline survives
    in the iteration (the policy kept the machine's nodes off neighbouring
    stages), both nodes are recorded dead for one reconfiguration, the other
    standby node takes the stage, and the losses are the reference's."""
    _, ref = bamboo_train(tmp_path / "ref.jsonl", *COMMON, "--stages", "1")
    with EtcdServer() as etcd:
        client = connect(etcd.endpoint)
        proc = subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd", etcd.endpoint,
                                 "--metrics-out", str(tmp_path / "m.jsonl"), *COMMON, "--local-hosts", "3",
                                 "--workers-per-host", "2", "--zones", "a,b,c", "--job", "hosts"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "TMPDIR": str(tmp_path)})  # its logs: nobody else's to clean
        _wait_for_iteration(client, 2, proc)
        cluster = Cluster(etcd.endpoint, "hosts")
        first = cluster.children(ASSIGNMENT())[0]
        pipe = first.pipelines[0]
        assert all(n // 2 != pipe[(s + 1) % 4] // 2 for s, n in enumerate(pipe))  # no machine on neighbours
        host = next(h for h in range(3) if (2 * h in pipe) != (2 * h + 1 in pipe))
        machine = next(p for p in psutil.Process(proc.pid).children()
                       if "--workers" in p.cmdline() and p.cmdline()[p.cmdline().index("--host") + 1] == f"host{host}")
        machine.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-2000:]
        epochs, failed, zones = cluster.children(ASSIGNMENT()), cluster.children(FAILED()), cluster.children(ZONES())
        cluster.close()
        client.close()
    lost = {2 * host, 2 * host + 1}
    assert {n: z.host for n, z in zones.items()} == {n: f"host{n // 2}" for n in range(6)}
    assert set(failed) == lost and any(f.how == HOST_LOST for f in failed.values())
    assert sorted(epochs) == [0, 1]  # written once for the machine's loss
    after = epochs[1]
    assert lost <= set(after.gone) and not lost & set(after.members) and not after.redo
    assert after.restore == "peers" and len(after.members) == 4 and not after.standby
    records = [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if "summary" not in r]
    assert [r["iteration"] for r in records] == list(range(ITERS))
    for got, want in zip(records, ref):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9), got["iteration"]
        assert got["samples"] == want["samples"]
    assert not any(e["type"] == "redo" for r in records for e in r["events"])
    assert sum(e["type"] == "failover" for r in records for e in r["events"]) == 1
