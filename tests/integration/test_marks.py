"""A pipeline's finished marks gathered on the data plane (bamboo/runtime/marks.py),
on a real etcd: the collector writes every mark, loss and report in one transaction,
counted by a watch of the test's own (the census), and what lands is what each node
sent; a death ends the gathering and the marks gathered are written at once; notes
that are not marks of the iteration are dropped."""
import json
import threading

import pytest

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import DONE, FINISHED, LOSS, Failure, Loss, Report
from bamboo.runtime.boundary import Boundary
from bamboo.runtime.failover import Failover
from bamboo.runtime.marks import BadNote, Gather, MarkNote, decode, encode
from bamboo.runtime.watch import PeerDead, Watch
from bamboo.state.checkpoint import Checkpoints
from commands.scale.census import Census
from commands.scale.emulator import Notes, Plane
from schedules.options import ScheduleOptions

IT = 7
NODES = (3, 5, 9)  # the collector is the first


def _reports() -> dict[int, Report]:
    return {n: Report(100.0 + n, 1000.0 + n, 2, busy=0.25 * n) for n in NODES}


def _pipeline(cluster: Cluster, final: bool = True) -> list[Failover]:
    notes, reports, out = Notes(), _reports(), []
    for me, node in enumerate(NODES):
        f = Failover(cluster, NODES, 0, me, ScheduleOptions(redundancy="off"), JobConfig(),
                     report_of=lambda r=reports[node]: r)
        f.now = Watch(iteration=IT, microbatches=3, failed=(), comm=None, streams={})
        f.now.gather = Gather(IT, NODES, node, Plane(notes, node, threading.Event()), final)
        out.append(f)
    return out


def _counted(etcd, job):
    census = Census(etcd.endpoint, job)
    return census, Cluster(etcd.endpoint, job)


def test_the_collector_writes_the_pipelines_marks_losses_and_reports_in_one_transaction(etcd):
    census, cluster = _counted(etcd, "marks-one")
    try:
        first, middle, last = _pipeline(cluster)
        last.finished(also={LOSS(IT, 0): Loss(2.5), LOSS(IT, 1): Loss(3.0)})  # the last stage holds the losses
        middle.finished()
        assert cluster.children(FINISHED(IT)) == {}  # nothing written by the senders
        first.finished()
        assert first.linger() is None
        assert middle.linger() is None and last.linger() is None  # told by the collector
        census.catch_up()
        assert census.transactions(range(IT, IT + 1)) == 1
        assert census.per_iteration(range(IT, IT + 1)) == {"done": 3, "finished": 3, "loss": 2}
        assert cluster.children(DONE(IT)) == _reports()  # what each node sent
        assert {g: r.value for g, r in cluster.children(LOSS(IT)).items()} == {0: 2.5, 1: 3.0}
        assert all(f.reported for f in (first, middle, last))
        boundary = Boundary(cluster, NODES[1], False, Checkpoints(JobConfig(), NODES[1], 6))
        boundary.report(IT, _reports()[NODES[1]], reported=True)
        census.catch_up()
        assert census.transactions(range(IT, IT + 1)) == 1  # a reported node writes no report
    finally:
        census.close()


def test_reports_that_are_not_final_stay_their_nodes_to_write(etcd):
    cluster = Cluster(etcd.endpoint, "marks-not-final")
    first, middle, last = _pipeline(cluster, final=False)
    for f in (middle, last, first):
        f.finished()
    assert first.linger() is None and middle.linger() is None
    assert set(cluster.children(FINISHED(IT))) == set(NODES)
    assert cluster.children(DONE(IT)) == {} and not first.reported and not middle.reported


def test_a_death_ends_the_gathering_and_what_was_gathered_is_written_at_once(etcd):
    cluster = Cluster(etcd.endpoint, "marks-death")
    first, middle, last = _pipeline(cluster)
    last.finished()
    cluster.record_dead(NODES[1], Failure(IT, NODES[0], "test"))  # the middle node dies before its mark
    first.finished()
    assert first.linger() == PeerDead(1)
    assert set(cluster.children(FINISHED(IT))) == {NODES[0], NODES[2]}  # its own and the one it gathered
    assert cluster.children(DONE(IT)) == {}  # reports are written at the boundary after a death
    assert last.linger() == PeerDead(1)
    assert not first.now.gather.on and not last.now.gather.on
    last.finished()  # after the recovery: its own mark, in etcd (the gathering is over)
    assert cluster.children(FINISHED(IT))[NODES[2]].report == _reports()[NODES[2]].to_dict()


def test_notes_that_are_no_marks_of_the_iteration_are_dropped(capsys):
    notes = Notes()
    gather = Gather(IT, NODES, NODES[0], Plane(notes, NODES[0], threading.Event()), final=True)
    sender = Plane(notes, NODES[1], threading.Event())
    for data in (b"\x80\x81", json.dumps({"iteration": "seven"}).encode(),
                 encode(MarkNote(IT - 1, NODES[1])),                   # another iteration's
                 encode(MarkNote(IT, NODES[2])),                       # another node's, by this sender
                 encode(MarkNote(IT, NODES[1], losses={"0": "nan"})),  # a loss that is no number
                 encode(MarkNote(IT, NODES[1], report={"rss_mb": "x"})),
                 encode(MarkNote(IT, NODES[1], {"rss_mb": 1.0, "time": 2.0, "epoch": 0}, {"4": 1.5}))):
        sender.note(NODES[0], data)
    gather.take()
    assert gather.notes[NODES[1]].losses == {"4": 1.5}
    assert capsys.readouterr().out.count("dropped") == 6
    with pytest.raises(BadNote, match="bytes"):
        decode(b" " * (1 << 17), IT, NODES[1])


def test_losses_sent_to_a_collector_that_stopped_gathering_are_written_by_their_node(etcd):
    cluster = Cluster(etcd.endpoint, "marks-losses")
    first, middle, last = _pipeline(cluster)
    cluster.record_dead(NODES[1], Failure(IT, NODES[0], "test"))
    first.finished()
    assert first.linger() == PeerDead(1)  # it stopped gathering before the last node's mark came
    last.finished(also={LOSS(IT, 5): Loss(1.25)})  # not yet aware of the death: its note goes out
    assert last.linger() == PeerDead(1)
    assert cluster.children(LOSS(IT)) == {}
    last.finished()  # after the recovery (the executor has nothing new to write)
    assert cluster.children(LOSS(IT)) == {5: Loss(1.25)}
