"""The iteration's end on a real etcd: each finished mark carries its node's report
(and the last stage's losses), and the node whose mark completes a pipeline that
lost nobody in the iteration writes every report of it with the regroup record, so
that nobody waits for the others to wake from their linger (docs/HOTPATH.md, "The
boundary's round trips")."""
import threading

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import ALIVE, DONE, LOSS, REGROUP, Alive, Local, Loss, Regroup, Report
from bamboo.runtime.boundary import Boundary
from bamboo.state.checkpoint import Checkpoints
from bamboo.runtime.failover import Failover
from bamboo.runtime.watch import Watch
from bamboo.control.config import JobConfig
from schedules.options import ScheduleOptions

IT = 4


def _node(cluster: Cluster, nodes: tuple[int, ...], me: int, report: Report) -> Failover:
    f = Failover(cluster, nodes, 0, me, ScheduleOptions(redundancy="off"), JobConfig(), report_of=lambda: report)
    f.now = Watch(iteration=IT, microbatches=3, failed=(), comm=None, streams={})
    return f


def _reports(nodes) -> dict[int, Report]:
    return {n: Report(100.0 + n, 1000.0 + n, 0, events=[{"n": n}], busy=0.5 + n) for n in nodes}


def _boundary(cluster: Cluster, node: int) -> Boundary:
    return Boundary(cluster, node, False, Checkpoints(JobConfig(), node, 6))


def _agree(boundary: Boundary, pipelines: int, failover: Failover) -> Regroup:
    return boundary.agree(IT, Assignment.static(stages=3, pipelines=pipelines), failover, (), lambda *_: None)


def _last_of_pipeline(cluster, nodes, reports, losses=None) -> Failover:
    """The pipeline's other nodes finish (and linger); then the first node's mark completes it."""
    for me in (1, 2):
        _node(cluster, nodes, me, reports[nodes[me]]).finished()
    last = _node(cluster, nodes, 0, reports[nodes[0]])
    last.finished(also=losses)
    assert last.linger() is None
    return last


def test_the_mark_that_completes_a_pipeline_writes_every_report_of_it_with_the_regroup_record(etcd):
    cluster, nodes = Cluster(etcd.endpoint, "finish-last"), (0, 1, 2)
    reports = _reports(nodes)
    last = _last_of_pipeline(cluster, nodes, reports, {LOSS(IT, 0): Loss(2.5)})
    assert cluster.get(LOSS(IT, 0)) == Loss(2.5)  # written with the mark
    boundary = _boundary(cluster, 0)
    boundary.report(IT, reports[0], last.now.completed)
    assert cluster.children(DONE(IT)) == {}  # nothing more written yet: the next write is the agreement's
    agreed = _agree(boundary, 1, last)
    assert agreed == Regroup((), False, False) and cluster.get(REGROUP(IT, 0)) == agreed
    assert cluster.children(DONE(IT)) == reports  # each what its node put in its mark


def test_a_completed_pipeline_writes_its_reports_before_it_waits_for_another_pipeline(etcd):
    cluster = Cluster(etcd.endpoint, "finish-two")
    reports = _reports(range(6))
    for n in reports:  # alive: a wait past LEASE_WAIT asks, and finds nobody silent
        cluster.put(ALIVE(n), Alive(n))
    last = _last_of_pipeline(cluster, (0, 1, 2), reports)
    boundary = _boundary(cluster, 0)
    boundary.report(IT, reports[0], last.now.completed)
    agreed = []
    waiting = threading.Thread(target=lambda: agreed.append(_agree(boundary, 2, last)), daemon=True)
    waiting.start()
    second = _last_of_pipeline(cluster, (3, 4, 5), reports)  # the other pipeline, on another "node"
    other = _boundary(cluster, 3)
    other.report(IT, reports[3], second.now.completed)
    # its agreement needs pipeline 0's reports, which the waiting node wrote before its wait
    assert _agree(other, 2, second) == Regroup((), False, False)
    waiting.join(timeout=30)
    assert agreed == [Regroup((), False, False)]
    assert cluster.children(DONE(IT)) == reports


def test_a_node_whose_mark_did_not_complete_the_pipeline_writes_only_its_own(etcd):
    cluster, nodes = Cluster(etcd.endpoint, "finish-first"), (0, 1, 2)
    reports = _reports(nodes)
    first = _node(cluster, nodes, 0, reports[0])
    first.finished()  # read with its mark: nodes 1 and 2 still run
    for me in (1, 2):
        _node(cluster, nodes, me, reports[me]).finished()
    assert first.linger(poll=0.01) is None  # woken later: the last mark was another's
    assert first.now.completed is None
    _boundary(cluster, 0).report(IT, reports[0], first.now.completed)
    assert cluster.children(DONE(IT)) == {0: reports[0]}


def test_after_a_death_in_the_iteration_no_mark_is_taken_for_a_final_report(etcd):
    """The survivors of a death recover and mark again: a mark written before the
    death carries a report that is no longer the node's."""
    cluster, nodes = Cluster(etcd.endpoint, "finish-death"), (0, 1, 2)
    reports = _reports(nodes)
    _node(cluster, nodes, 2, reports[2]).finished()
    last = _node(cluster, nodes, 0, reports[0])
    last.now.failed, last.now.recovered = (Local(1),), True  # as resolve() leaves them: node 1 died
    last.finished()
    assert last.linger() is None  # every live node finished ...
    assert last.now.completed is None  # ... but the marks are not taken as final reports


def test_a_completed_pipeline_takes_no_mark_of_another_pipeline_for_a_report(etcd):
    """Node 4 of pipeline (3, 4, 5) has finished, and its predecessor 3 still runs
    (with --replica-sync next it may die after its reduce, and node 4 must then take
    stage 0 over). Pipeline (0, 1, 2) completing writes its own three reports, not
    node 4's: node 4 writes its own once its pipeline is done."""
    cluster = Cluster(etcd.endpoint, "finish-other")
    reports = _reports(range(6))
    _node(cluster, (3, 4, 5), 1, reports[4]).finished()
    last = _last_of_pipeline(cluster, (0, 1, 2), reports)
    assert set(last.now.completed.marks) == {0, 1, 2}
    boundary = _boundary(cluster, 0)
    boundary.report(IT, reports[0], last.now.completed)
    boundary.cluster.put_all(boundary.unwritten)  # what a wait for another pipeline writes first
    assert set(cluster.children(DONE(IT))) == {0, 1, 2}


def test_a_node_that_does_not_lead_the_boundary_waits_for_the_agreement_and_proposes_nothing(etcd):
    """Every report is in (its pipeline's collector wrote them). Node 4 does not
    lead (node 0, the first member, does): its look finds no agreement, it writes
    none, and it returns the leader's once the leader wrote it. Before, every node
    proposed, each reading every member."""
    cluster, follower_cluster = Cluster(etcd.endpoint, "finish-follow"), Cluster(etcd.endpoint, "finish-follow")
    reports = _reports(range(6))
    for n in reports:  # alive: a wait past LEASE_WAIT asks, and finds nobody silent
        cluster.put(ALIVE(n), Alive(n))
    cluster.put_all({DONE(IT, n): r for n, r in reports.items()})
    looked, agreed = threading.Event(), []
    read = follower_cluster.read_with_aborts
    follower_cluster.read_with_aborts = lambda *a: (read(*a), looked.set())[0]
    proposed = []
    follower_cluster.create_or_get = lambda *a, **k: proposed.append(a)  # a proposal: it must make none
    follower = Boundary(follower_cluster, 4, False, Checkpoints(JobConfig(), 4, 6),
                        changes=follower_cluster.changes(REGROUP()))
    follower.report(IT, reports[4], reported=True)
    waiting = threading.Thread(target=lambda: agreed.append(_agree(follower, 2, _node(follower_cluster, (3, 4, 5), 1,
                                                                                      reports[4]))), daemon=True)
    waiting.start()
    assert looked.wait(30)
    assert cluster.children(REGROUP(IT)) == {}  # the follower looked, and wrote nothing
    leader = _boundary(cluster, 0)
    leader.report(IT, reports[0], reported=True)
    assert _agree(leader, 2, _node(cluster, (0, 1, 2), 0, reports[0])) == Regroup((), False, False)
    waiting.join(timeout=30)
    assert agreed == [Regroup((), False, False)] and list(cluster.children(REGROUP(IT))) == [0]
    assert proposed == []


def test_a_node_armed_at_the_iteration_start_looks_only_once_the_agreement_came(etcd):
    """Node 4 armed its watch as the iteration began, and its collector wrote its
    report: it reads etcd once, when the leader's agreement came (a node that did
    not arm looks once more on arrival, as the test above shows)."""
    cluster, follower_cluster = Cluster(etcd.endpoint, "finish-armed"), Cluster(etcd.endpoint, "finish-armed")
    reports = _reports(range(6))
    for n in reports:
        cluster.put(ALIVE(n), Alive(n))
    looks, waiting_now, agreed = [], threading.Event(), []
    read = follower_cluster.read_with_aborts
    follower_cluster.read_with_aborts = lambda *a: (looks.append(a), read(*a))[1]
    follower = Boundary(follower_cluster, 4, False, Checkpoints(JobConfig(), 4, 6),
                        changes=follower_cluster.changes(REGROUP()))
    follower.arm()
    cluster.put_all({DONE(IT, n): r for n, r in reports.items()})  # the collectors' transactions
    follower.report(IT, reports[4], reported=True)
    failover = _node(follower_cluster, (3, 4, 5), 1, reports[4])
    waiting = threading.Thread(target=lambda: agreed.append(follower.agree(
        IT, Assignment.static(stages=3, pipelines=2), failover, (), lambda *_: None, idle=waiting_now.set)),
        daemon=True)
    waiting.start()
    assert waiting_now.wait(30) and looks == []  # it waits, having read nothing
    leader = _boundary(cluster, 0)
    leader.report(IT, reports[0], reported=True)
    assert _agree(leader, 2, _node(cluster, (0, 1, 2), 0, reports[0])) == Regroup((), False, False)
    waiting.join(timeout=30)
    assert agreed == [Regroup((), False, False)] and len(looks) == 1
