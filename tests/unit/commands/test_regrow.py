"""The local launcher's side of --surplus (commands/train/regrow.py), without
processes: a stand-in launcher records the agents it would start, and a stand-in
etcd holds the decisions, members and deaths."""
from types import SimpleNamespace

import pytest

from bamboo.control.config import JobConfig
from bamboo.control.protocol import Failure, Member, Release, Timestamp
from commands.train import regrow
from commands.train.launcher import LocalCluster


class Proc:
    def __init__(self, alive=True):
        self.alive = alive

    def poll(self):
        return None if self.alive else 0


class Etcd:
    """children(prefix) by the family's name, as Cluster.children answers."""

    def __init__(self, **families):
        self.families = families

    def children(self, prefix):
        return dict(self.families.get(prefix.family.name, {}))


class Launcher:
    def __init__(self, nodes: int, zones=("a", "b", "c"), acquire=5.0):
        self.cfg = JobConfig.of(surplus="burst", acquire_seconds=acquire)
        self.local = LocalCluster(nodes, zones)
        self.procs = {n: Proc() for n in range(nodes)}
        self.logs = "/tmp"
        self.started = []

    def _start(self, cluster, key, module, *args, named=True):
        self.started.append((key, args[args.index("--zone") + 1], named))
        self.procs[key] = Proc()


def members(zones: dict[int, str]) -> dict:
    return {n: Member(z, None, 0) for n, z in zones.items()}


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=100.0)
    monkeypatch.setattr(regrow.time, "monotonic", lambda: now.t)
    return now


def test_releases_are_said_once_and_the_missing_nodes_start_after_the_wait(clock, capsys):
    """Six nodes in zones a,b,c,a,b,c; nodes 1 and 2 died (zones b and c) and the job
    asks for six: two newcomers, 5 s later, one in b and one in c (the fewest)."""
    launcher = Launcher(6)
    etcd = Etcd(releases={0: Release((), 0, 6, 6, 0.0)}, failed={1: Failure(3, 0), 2: Failure(3, 0)},
                members=members({n: "abcabc"[n] for n in range(6)}))
    launcher.procs[1].alive = launcher.procs[2].alive = False
    grow = regrow.Regrow(launcher, "agents.agent")
    grow.tick(etcd)
    assert launcher.started == [] and grow.due == [105.0, 105.0]
    clock.t = 104.9
    grow.tick(etcd)
    assert launcher.started == []
    clock.t = 105.0
    grow.tick(etcd)
    assert sorted(z for _, z, _ in launcher.started) == ["b", "c"]
    assert all(key >= regrow.FIRST_KEY and not named for key, _, named in launcher.started)  # ids their own
    grow.tick(etcd)
    assert len(launcher.started) == 2  # held again: nothing more asked


def test_a_release_is_printed_once_and_no_more_than_the_launch_is_asked_for(clock, capsys):
    launcher = Launcher(4)
    etcd = Etcd(releases={0: Release((3,), 0, 3, 4, 0.0), 1: Release((), 2, 10 ** 9, 4, 0.0)},
                members=members({n: "abca"[n] for n in range(4)}), drain={3: Timestamp(1.0)})
    launcher.procs[3].alive = False
    grow = regrow.Regrow(launcher, "agents.agent")
    grow.tick(etcd)
    grow.tick(etcd)
    err = capsys.readouterr().err
    assert err.count("node 3 released") == 1
    assert len(grow.due) == 1  # a desired count of 10^9 from etcd is held to the four nodes launched
