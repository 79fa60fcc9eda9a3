"""bamboo-status reads a job's state from etcd, as a job left it."""
import json
import subprocess
import sys

import pytest

from bamboo.control.etcd import EtcdServer
from tests.training import bamboo_train


@pytest.mark.slow  # make test-slow: a whole job first (bamboo-status on a live job is test_dashboard.py)
def test_status_of_a_finished_job_with_a_preemption(tmp_path):
    with EtcdServer() as etcd:
        bamboo_train(tmp_path / "m.jsonl", "--stages", "2", "--microbatches", "4", "--iterations", "4",
                     "--preempt", "1@1:3", "--etcd", etcd.endpoint)
        out = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        (status,) = [json.loads(line) for line in out.stdout.splitlines()]
        assert (status["model"], status["stages"], status["pipelines"]) == ("tiny", 2, 1)
        assert status["last_iteration"] == 3 and status["iterations_per_second"] > 0
        assert list(status["failed"]) == ["1"] and status["failed"]["1"]["iteration"] == 1
        text = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint],
                              capture_output=True, text=True, timeout=60).stdout
        assert "iteration 3 of 4" in text and "failed: node 1 in iteration 1" in text


@pytest.mark.slow  # make test stays under 15 minutes on a 2-core machine
def test_status_of_a_local_cluster_shows_zones_assignment_and_standby(tmp_path):
    with EtcdServer() as etcd:
        bamboo_train(tmp_path / "m.jsonl", "--stages", "2", "--microbatches", "4", "--iterations", "3",
                     "--local-nodes", "3", "--zones", "a,b", "--etcd", etcd.endpoint, "--max-stages-per-node", "1",
                     "--surplus", "keep")  # the standby stays: two trainers justify none by the burst rule
        out = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint, "--json"],
                             capture_output=True, text=True, timeout=60)
        (status,) = [json.loads(line) for line in out.stdout.splitlines()]
        assert status["zones"] == {"0": "a", "1": "b", "2": "a"}
        assert status["assignment"] == [[0, 1]] and status["standby"] == [2] and status["epoch"] == 0
        assert status["last_iteration"] == 2 and status["pipelines"] == 1
        text = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint],
                              capture_output=True, text=True, timeout=60).stdout
        assert "pipeline 0: stage 0: node 0" in text and "standby: 2" in text and "(eager redundancy)" in text


def test_status_of_an_unreachable_etcd_is_one_line():
    out = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "unreachable" in out.stderr



@pytest.mark.parametrize("command,args,message", [
    ("status", ["--serve", "0", "--refresh", "inf"], "--refresh inf: expected a finite number"),
    ("status", ["--serve", "0", "--price", "inf"], "'inf': expected SPOT[,ONDEMAND]"),
    ("agent", ["--job", "j", "--zone", "a", "--min-nodes", "-1"], "--min-nodes must be at least 1 (got -1)"),
    ("agent", ["--job", "j", "--zone", "a", "--node", "-1"], "--node must be at least 0 (got -1)"),
    ("agent", ["--job", "j", "--zone", " "], "--zone must not be empty"),
])
def test_bad_input_is_refused_before_etcd_is_asked(capsys, command, args, message):
    """The etcd is unreachable: a refusal that waited for it would say so instead."""
    from agents import agent
    from commands.status import status
    with pytest.raises(SystemExit) as exited:
        {"status": status.main, "agent": agent.main}[command](["--etcd", "127.0.0.1:1", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and message in lines[-1], lines
