"""bamboo-launch dashboard from this machine: the job's etcd does not answer from
here (its private address), so the page goes through a tunnel, Session Manager's
on EC2, gcloud's on GCP, or ssh; the tunnel closes with the dashboard.

The tunnel programs are stand-ins (tests/fake_tunnel.py) that take each real
tool's arguments and relay to a real etcd holding the job; the dashboard, its
etcd client and the job's config are the real ones."""
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from cloud.job import JobStore
from bamboo.control.config import JobConfig
from cloud.records import write_records

BIN = os.path.dirname(sys.executable)
STANDIN = os.path.join(os.path.dirname(__file__), "..", "fake_tunnel.py")
UNREACHABLE = "127.0.0.1:1"  # the etcd's address as the launch recorded it: nothing answers there from here


def record(provider: str) -> dict:
    base = {"provider": provider, "name": "watch", "region": "us-east-1", "job": "watched", "etcd": UNREACHABLE,
            "wheel": None, "zones": ["a"], "nodes": 2}
    if provider == "ec2":
        return {**base, "etcd_instance": "i-0e7cd", "instance_types": ["g5.xlarge"]}
    return {**base, "project": "proj", "etcd_instance": "us-central1-a/bamboo-etcd", "priced_as": "g2-standard-8"}


@pytest.fixture
def standins(tmp_path, etcd, monkeypatch):
    """aws, gcloud and ssh on PATH, each relaying to the real etcd; their log."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool in ("aws", "gcloud", "ssh"):
        path = shims / tool
        path.write_text(f'#!/bin/sh\nexec {sys.executable} {os.path.abspath(STANDIN)} "$0" "$@"\n')
        path.chmod(0o755)
    log = tmp_path / "tunnels.jsonl"
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_TUNNEL_LOG", str(log))
    monkeypatch.setenv("FAKE_TUNNEL_TARGET", etcd.endpoint)
    store = JobStore(etcd.endpoint, "watched")
    store.remove()  # the etcd outlives one test
    store.write(JobConfig.of(name="tiny", stages=2, job="watched", elastic=True))
    store.cluster.close()
    return log


@pytest.mark.parametrize("provider,via,extra,tool,stop", [
    ("ec2", "auto", [], "aws", signal.SIGTERM),
    ("gcp", "auto", [], "gcloud", signal.SIGHUP),   # a closed terminal
    ("ec2", "ssh", ["--ssh-host", "ec2-user@203.0.113.7", "--ssh-key", "k.pem"], "ssh", signal.SIGINT),
])
def test_the_dashboard_goes_through_the_tunnel_and_closes_it(tmp_path, standins, provider, via, extra, tool, stop):
    state = tmp_path / "state.json"
    write_records(str(state), {"watched": record(provider)})
    proc = subprocess.Popen([os.path.join(BIN, "bamboo-launch"), "--state", str(state), "dashboard", "watched",
                             "--via", via, *extra, "--no-browser", "--port", "0", "--seconds", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the page's address, once the tunnel and the server stand
        assert "dashboard at http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" at ")[1].split()[0]
        job = json.load(urllib.request.urlopen(url + "api/job", timeout=30))
        assert job["job"] == "watched" and job["model"] == "tiny"
        # priced at the recorded instance type's prices (commands/train/instances.py), not typed in
        prices = (0.45, 1.006) if provider == "ec2" else (0.34, 0.854)
        assert (job["cost"]["spot_price"], job["cost"]["on_demand_price"]) == prices
    finally:
        proc.send_signal(stop)
        proc.wait(30)
    (opened,) = [json.loads(x) for x in standins.read_text().splitlines()]
    assert opened["tool"] == tool and opened["remote"] == 1  # forwarded to the recorded etcd's port
    if tool == "aws":
        assert opened["argv"][:2] == ["ssm", "start-session"] and "i-0e7cd" in opened["argv"]
    if tool == "gcloud":
        assert opened["argv"][:3] == ["compute", "ssh", "bamboo-etcd"] and "us-central1-a" in opened["argv"]
    if tool == "ssh":
        assert opened["argv"][-1] == "ec2-user@203.0.113.7" and ["-i", "k.pem"] == opened["argv"][3:5]
    with pytest.raises(ProcessLookupError):
        os.kill(opened["pid"], 0)  # the tunnel went with the dashboard


def test_an_etcd_of_ones_own_that_does_not_answer_asks_for_a_way_in(tmp_path, capsys):
    from cloud import launch
    state = tmp_path / "state.json"
    write_records(str(state), {"watched": {**record("ec2"), "etcd_instance": None}})
    assert launch.main(["--state", str(state), "dashboard", "--no-browser"]) == 1
    err = capsys.readouterr().err
    assert "give --via ssh --ssh-host USER@HOST" in err and err.count("\n") == 1
    assert launch.main(["--state", str(state), "dashboard", "--ssh-host", "x@y"]) == 2
    assert "--ssh-host and --ssh-key go with --via ssh" in capsys.readouterr().err
