"""The launcher's judgement that a job has nobody left, on a real etcd: a burst can
take every node it started while replacements started elsewhere are still booting,
unseen until their agents register."""
import subprocess
import sys
import threading

import pytest

from commands.train import launcher as launcher_module
from commands.train.launcher import LaunchError, Launcher, LocalCluster, Rewind
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import ASSIGNMENT, FAILED, MEMBERS, Failure, Member


def _orphaned_launcher(etcd, elastic: bool) -> tuple[Launcher, Cluster]:
    """A launcher of two local nodes whose processes both exited (SIGKILLed)."""
    cfg = JobConfig.of(job=f"orphan-{elastic}", elastic=elastic)
    launcher = Launcher(cfg, cluster=LocalCluster(nodes=2) if elastic else None, named=True)
    for node in (0, 1):
        proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        proc.wait()
        launcher.procs[node] = proc
    return launcher, Cluster(etcd.endpoint, cfg.cluster.job)


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


def test_an_iteration_whose_every_member_died_unreported_waits_for_the_redo_epoch(etcd):
    """Chaos seed 18: a burst killed every member of a redo epoch before any
    reported; the launcher took "all reported or dead" as done and failed the
    job with "0 of 6 microbatch losses arrived" four etcd revisions before the
    agents wrote the epoch that carried on. It must wait for that epoch."""
    launcher, cluster = _orphaned_launcher(etcd, elastic=True)
    launcher.procs.clear()  # agents elsewhere (a replacement joins): not this launcher's to judge
    cluster.put(ASSIGNMENT(0), Assignment.static(2, 1))
    cluster.put(ASSIGNMENT(1), Assignment(epoch=1, start=10, pipelines=((2, 3),), standby=(5,), redo=True))
    launcher._redone = 1  # epoch 1 rewound to already
    for node in (2, 3):
        cluster.put(FAILED(node), Failure(iteration=10, by=5, how="lease expired"))
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(_wait(launcher, cluster, 10)), daemon=True)
    waiter.start()
    waiter.join(timeout=1.5)  # several looks at etcd (woken by the deaths' watch, else every 0.5 s)
    assert waiter.is_alive() and not outcome  # not finished: nobody reported
    cluster.put(ASSIGNMENT(2), Assignment(epoch=2, start=0, pipelines=((5, 7),), redo=True, restore="initial"))
    waiter.join(timeout=30)
    assert outcome and isinstance(outcome[0], Rewind) and outcome[0].assignment.epoch == 2


def _wait(launcher: Launcher, cluster: Cluster, it: int):
    try:
        return launcher._wait_iteration(cluster, it, since=1e12)
    except Rewind as rewind:
        return rewind
