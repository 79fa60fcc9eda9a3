"""The iteration's end on a real etcd: each finished mark carries its node's report
(and the last stage's losses), and the node whose mark completes a pipeline that
lost nobody in the iteration writes every report of it, so that nobody waits for
the others to wake from their linger (docs/HOTPATH.md, "The boundary's round trips")."""
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import DONE, LOSS, Local, Loss, Report
from bamboo.runtime.boundary import Boundary
from bamboo.runtime.checkpoint import Checkpoints
from bamboo.runtime.failover import Failover, Watch

NODES = (10, 11, 12)
IT = 4


def _node(cluster: Cluster, me: int, report: Report) -> Failover:
    f = Failover(cluster, NODES, 0, me, "off", 3.0, report_of=lambda: report)
    f.now = Watch(iteration=IT, microbatches=3, failed=(), comm=None, streams={})
    return f


def _reports() -> dict[int, Report]:
    return {n: Report(100.0 + n, 1000.0 + n, 0, events=[{"n": n}], busy=0.5 + n) for n in NODES}


def test_the_mark_that_completes_a_pipeline_writes_every_report_of_it(etcd):
    cluster, reports = Cluster(etcd.endpoint, "finish-last"), _reports()
    for me in (1, 2):  # nodes 11 and 12 finished first: they linger
        _node(cluster, me, reports[NODES[me]]).finished()
    last = _node(cluster, 0, reports[10])
    last.finished(also={LOSS(IT, 0): Loss(2.5)})
    assert last.linger() is None
    boundary = Boundary(cluster, 10, False, Checkpoints(None, 10, 6))
    boundary.report(IT, reports[10], last.now.completed)
    assert cluster.children(DONE(IT)) == reports  # each what its node put in its mark
    assert boundary.seen[0] == reports            # read with the write: nothing to wait for
    assert cluster.get(LOSS(IT, 0)) == Loss(2.5)  # written with the mark


def test_a_node_whose_mark_did_not_complete_the_pipeline_writes_only_its_own(etcd):
    cluster, reports = Cluster(etcd.endpoint, "finish-first"), _reports()
    first = _node(cluster, 0, reports[10])
    first.finished()  # read with its mark: nodes 11 and 12 still run
    for me in (1, 2):
        _node(cluster, me, reports[NODES[me]]).finished()
    assert first.linger(poll=0.01) is None  # woken later: the last mark was another's
    assert first.now.completed is None
    Boundary(cluster, 10, False, Checkpoints(None, 10, 6)).report(IT, reports[10], first.now.completed)
    assert cluster.children(DONE(IT)) == {10: reports[10]}


def test_after_a_death_in_the_iteration_no_mark_is_taken_for_a_final_report(etcd):
    """The survivors of a death recover and mark again: a mark written before the
    death carries a report that is no longer the node's."""
    cluster, reports = Cluster(etcd.endpoint, "finish-death"), _reports()
    _node(cluster, 2, reports[12]).finished()
    last = _node(cluster, 0, reports[10])
    last.now.failed, last.now.recovered = (Local(1),), True  # as resolve() leaves them: node 11 died
    last.finished()
    assert last.linger() is None  # every live node finished ...
    assert last.now.completed is None  # ... but the marks are not taken as final reports
