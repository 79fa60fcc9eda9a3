"""The launcher's judgement that a job has nobody left, on a real etcd: a burst can
take every node it started while replacements started elsewhere are still booting,
unseen until their agents register."""
import subprocess
import sys

import pytest

from commands.train import launcher as launcher_module
from commands.train.launcher import LaunchError, Launcher, LocalCluster
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import MEMBERS, Member


def _orphaned_launcher(etcd, elastic: bool) -> tuple[Launcher, Cluster]:
    """A launcher of two local nodes whose processes both exited (SIGKILLed)."""
    cfg = JobConfig(job=f"orphan-{elastic}", elastic=elastic)
    launcher = Launcher(cfg, cluster=LocalCluster(nodes=2) if elastic else None, named=True)
    for node in (0, 1):
        proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        proc.wait()
        launcher.procs[node] = proc
    return launcher, Cluster(etcd.endpoint, cfg.job)


def test_without_agents_a_job_whose_workers_all_exited_ends_at_once(etcd):
    launcher, cluster = _orphaned_launcher(etcd, elastic=False)
    with pytest.raises(LaunchError, match="every worker exited while waiting for iteration 3$"):
        launcher._check_workers(cluster, 1e12, "iteration 3")


def test_with_agents_it_waits_for_a_joiner_and_gives_up_after_the_grace(etcd, monkeypatch, capsys):
    launcher, cluster = _orphaned_launcher(etcd, elastic=True)
    since = 1e12  # far from --stall-timeout
    launcher._check_workers(cluster, since, "iteration 7 to finish")  # the first look starts the grace
    assert "waiting up to 60 s for an agent to join" in capsys.readouterr().err
    launcher._check_workers(cluster, since, "iteration 7 to finish")  # still within it
    monkeypatch.setattr(launcher_module, "REJOIN_GRACE", 0.0)
    with pytest.raises(LaunchError, match="no agent joined within 0 s"):
        launcher._check_workers(cluster, since, "iteration 7 to finish")


def test_an_agent_registered_elsewhere_keeps_the_job_and_resets_the_grace(etcd, monkeypatch):
    launcher, cluster = _orphaned_launcher(etcd, elastic=True)
    monkeypatch.setattr(launcher_module, "REJOIN_GRACE", 0.0)
    launcher._check_workers(cluster, 1e12, "iteration 7 to finish")
    cluster.put(MEMBERS(5), Member(zone="a", host="replacement"))  # node 5: not one this launcher started
    launcher._check_workers(cluster, 1e12, "iteration 7 to finish")
    launcher._check_workers(cluster, 1e12, "iteration 7 to finish")
    assert launcher._orphaned_since is None
    cluster.delete(MEMBERS(5))  # the replacement is gone too: a fresh grace, then the end
    launcher._check_workers(cluster, 1e12, "iteration 7 to finish")
    with pytest.raises(LaunchError, match="every worker exited while waiting for iteration 7 to finish, and no agent"):
        launcher._check_workers(cluster, 1e12, "iteration 7 to finish")
