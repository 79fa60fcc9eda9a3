"""Preemption notices from fake metadata servers on loopback (EC2 IMDSv2 with
session tokens, GCP with its Metadata-Flavor header): the watchers, and a local
cluster in which a notice makes a node hand its stage over before it goes."""
import subprocess
import sys
import time

import pytest

from agents.notices import Ec2Notice, GcpNotice, watch
from bamboo.control.etcd import EtcdServer
from tests.fake_metadata import FakeMetadata
from tests.integration.test_agents import (COMMON, ITERS, _records, _wait_for_iteration, assert_same_training, reconfigurations,
                               reference)


@pytest.fixture
def metadata():
    server = FakeMetadata()
    yield server
    server.shutdown()


def test_ec2_watcher_uses_a_session_token(metadata):
    notice = Ec2Notice(metadata.url)
    assert notice.poll() is None and metadata.tokens  # a token was fetched and used
    metadata.tokens.clear()                          # the token expired: a new one is fetched
    assert notice.poll() is None and notice._token is None
    metadata.noticed.add("")
    assert notice.poll() == {"action": "terminate", "time": "2026-11-22T05:00:00Z"}


def test_gcp_watcher_and_the_background_thread(metadata):
    assert GcpNotice(metadata.url).poll() is None
    heard = []
    stop = watch("gcp", heard.append, metadata.url, interval=0.05)
    time.sleep(0.3)
    assert heard == []
    metadata.noticed.add("")
    deadline = time.monotonic() + 10
    while not heard and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    assert heard == [{"action": "preempted", "source": "gcp"}]


@pytest.mark.slow
def test_a_notice_hands_the_stage_over_before_the_kill(tmp_path, tmp_path_factory, metadata):
    """Three nodes (one standby) watch EC2 notices; node 1 gets one after iteration
    3: it leaves at the next boundary with its stage handed to the standby node, no
    failover, no failure recorded, and the same losses as the reference."""
    with EtcdServer() as etcd:
        proc = subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd", etcd.endpoint,
                                 "--metrics-out", str(tmp_path / "m.jsonl"), "--save-dir", str(tmp_path / "params"),
                                 *COMMON, "--microbatches", "4", "--local-nodes", "3", "--zones", "a,b",
                                 "--max-stages-per-node", "1", "--surplus", "keep",  # the standby stays
                                 "--notice", "ec2", "--metadata-url", metadata.url + "/{node}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_iteration(etcd, 3, proc)
        metadata.noticed.add("1")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    records = _records(tmp_path)
    assert len(records) == ITERS
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))
    notices = [e for r in records for e in r["events"] if e["type"] == "notice"]
    assert notices == [{"type": "notice", "node": 1, "source": "ec2", "action": "terminate"}]
    assert not any(e["type"] in ("failover", "preemption") for r in records for e in r["events"])
    last = reconfigurations(records)[-1][1]
    assert sorted(last["pipelines"][0]) == [0, 2] and last["standby"] == []
