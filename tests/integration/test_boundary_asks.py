"""Who asks etcd about leases at the iteration's end, on a real etcd: a slow boundary
costs a few nodes' asks, not every node's, and a burst that took the head of the
line (the leader and the nodes next in it) is still found, in one round. A node
whose key is gone is silent at once, so these tests need no lease to age."""
import threading

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import ALIVE, DONE, FAILED, REGROUP, Alive, Regroup, Report
from bamboo.runtime.boundary import LINE_ASKERS, Boundary
from bamboo.runtime.failover import Failover
from bamboo.runtime.watch import Watch
from bamboo.state.checkpoint import Checkpoints
from schedules.options import ScheduleOptions

IT = 3
MEMBERS = tuple(range(12))  # 4 pipelines of 3


def _report(n: int) -> Report:
    return Report(100.0, 1000.0 + n, 0, busy=0.5)


class _Node:
    """A node at the boundary on a cluster of its own, its lease asks logged."""

    def __init__(self, etcd, job: str, node: int, asks: list):
        self.node = node
        self.cluster = Cluster(etcd.endpoint, job)
        ask = self.cluster.record_silent
        self.cluster.record_silent = lambda nodes, *a, **k: (asks.append((node, tuple(nodes))), ask(nodes, *a, **k))[1]
        self.boundary = Boundary(self.cluster, node, True, Checkpoints(JobConfig(), node, 6),
                                 changes=self.cluster.changes(FAILED(), REGROUP()))
        pipeline = node // 3
        self.failover = Failover(self.cluster, MEMBERS[3 * pipeline:3 * pipeline + 3], pipeline, node % 3,
                                 ScheduleOptions(redundancy="off"), JobConfig())
        self.failover.now = Watch(iteration=IT, microbatches=3, failed=(), comm=None, streams={})
        self.agreed: list = []

    def wait(self) -> threading.Thread:
        assignment = Assignment.static(stages=3, pipelines=4)
        self.boundary.report(IT, _report(self.node), reported=True)
        t = threading.Thread(target=lambda: self.agreed.append(
            self.boundary.agree(IT, assignment, self.failover, (), lambda *_: None)), daemon=True)
        t.start()
        return t


def _job(etcd, job: str, dead: set, asks: list) -> list[_Node]:
    """Every member's report is in but the dead's, and every live member's key."""
    writer = Cluster(etcd.endpoint, job)
    writer.put_all({**{ALIVE(n): Alive(n) for n in MEMBERS if n not in dead},
                    **{DONE(IT, n): _report(n) for n in MEMBERS if n not in dead}})
    return [_Node(etcd, job, n, asks) for n in MEMBERS if n not in dead]


def test_a_dead_leader_is_found_by_a_few_nodes_not_by_every_one(etcd):
    """The leader (node 0) died before its report. With a 3 s failure timeout, only
    LINE_ASKERS of the eleven waiting nodes ask after it at the first asking time;
    one records it dead, node 1 leads and writes the agreement without it (the
    agents then reconfigure)."""
    asks: list = []
    nodes = _job(etcd, "asks-leader", {0}, asks)
    for t in [n.wait() for n in nodes]:
        t.join(timeout=60)
    assert all(n.agreed == [Regroup((0, ), True, False)] for n in nodes)
    askers = {node for node, asked in asks if 0 in asked}
    assert 1 <= len(askers) <= LINE_ASKERS
    assert Cluster(etcd.endpoint, "asks-leader").get(FAILED(0)).by in askers


def test_a_burst_that_took_the_head_of_the_line_is_recorded_in_one_round(etcd):
    """Nodes 0, 1 and 2 (the leader and the next two in line) died before their
    reports: a node that finds the leader silent asks after the others ahead of it
    in the same round, not once each has led; the survivors agree on all three."""
    asks: list = []
    nodes = _job(etcd, "asks-burst", {0, 1, 2}, asks)
    for t in [n.wait() for n in nodes]:
        t.join(timeout=60)
    assert all(n.agreed == [Regroup((0, 1, 2), True, False)] for n in nodes)
    assert sorted(Cluster(etcd.endpoint, "asks-burst").children(FAILED())) == [0, 1, 2]
    assert any({1, 2} <= set(asked) for _, asked in asks)  # one ask, not a round per leader
