"""bamboo/control/changes.py against a real etcd: the flag a watch raises, what a
reader sees when etcd restarts under the watch (it must never miss a change), and
the watches a process's readers share (counted by etcd itself)."""
import time

from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ABORT, FAILED, FINISHED, LOAN, REGROUP, Abort, Failure, Finished, Mark
from commands.scale.census import WATCH_EVENTS, WATCHERS, etcd_counters


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_write_under_a_watched_prefix_raises_the_flag_and_others_do_not(etcd):
    cluster = Cluster(etcd.endpoint, "changes")
    changes = cluster.changes(FAILED(), ABORT())
    assert changes.take()          # armed: whatever came before is to be read once
    assert not changes.take()
    cluster.put(FINISHED(1, 0), Finished())          # another prefix
    assert not changes.wait(0.5) and not changes.take()
    cluster.create(FAILED(3), Failure(1, 0, "test"))
    assert changes.wait(10) and changes.take()
    assert not changes.take()      # lowered by the take
    cluster.create(ABORT(1), Abort("test", 0))
    assert changes.wait(10) and changes.take()


def test_a_watch_lost_with_etcd_reads_every_time_then_is_armed_again():
    with EtcdServer() as server:
        cluster = Cluster(server.endpoint, "changes", patience=30)
        changes = cluster.changes(FAILED())
        changes.take()
        server.kill()
        deadline = time.monotonic() + 30
        while not changes.lost and time.monotonic() < deadline:  # pyetcd reports the broken stream
            changes.wait(0.1)
        assert changes.lost
        assert changes.take() and changes.take()   # while lost, every take says "read"
        server.start()
        cluster.create(FAILED(5), Failure(2, 0, "test"))  # written while no watch may be armed
        deadline = time.monotonic() + 30
        while changes.lost and time.monotonic() < deadline:
            assert changes.take()  # lost, or armed just now: either way, read
            time.sleep(0.1)
        assert not changes.lost and 5 in cluster.failed()
        cluster.create(FAILED(6), Failure(2, 0, "test"))
        assert changes.wait(10) and changes.take()


def test_the_readers_own_write_is_no_news_but_anything_else_is(etcd):
    """take(own=KEY): the reader writes KEY next and reads it back with the write, so
    the watch's event for that put must not wake it again; another node's write and
    a delete of KEY still do. After close() nothing wakes it."""
    cluster = Cluster(etcd.endpoint, "changes-own")
    changes = cluster.changes(FINISHED())
    changes.take()
    assert not changes.take(own=FINISHED(1, 0))
    cluster.put(FINISHED(1, 0), Finished())              # its own mark
    assert not changes.wait(0.5) and not changes.take()
    cluster.put(FINISHED(1, 1), Finished())              # a peer's
    assert changes.wait(10) and changes.take()
    cluster.client.delete(cluster.key(FINISHED(1, 0)))  # its own key, gone
    assert changes.wait(10) and changes.take()
    changes.close()
    cluster.put(FINISHED(1, 2), Finished())
    assert not changes.wait(0.5)


def test_a_process_asks_etcd_once_for_each_prefix_however_many_readers_read_it(etcd):
    """A worker's failover, linger and boundary all read failed/ and abort/. etcd
    holds one watch per prefix for the process and sends each write once, every
    reader is still woken, a closed reader no longer is, and the watches go with
    the last reader. Counted by etcd (its watchers, and the events it sent)."""
    watchers = lambda: etcd_counters(etcd.endpoint)[WATCHERS]  # noqa: E731
    before = watchers()
    cluster, writer = Cluster(etcd.endpoint, "shared"), Cluster(etcd.endpoint, "shared")
    readers = [cluster.changes(FAILED(), ABORT(), LOAN()), cluster.changes(FAILED(), ABORT()),
               cluster.changes(FAILED(), ABORT(), REGROUP())]
    assert all([r.take() for r in readers]) and not any(r.take() for r in readers)
    assert watchers() - before == 4  # failed, abort, loan, regroup (ten, one a prefix a reader)
    sent = etcd_counters(etcd.endpoint)[WATCH_EVENTS]
    writer.create(FAILED(3), Failure(1, 0, "test"))
    assert all(r.wait(10) for r in readers) and all([r.take() for r in readers])
    assert etcd_counters(etcd.endpoint)[WATCH_EVENTS] - sent == 1
    readers[0].close(), readers[1].close()
    writer.create(ABORT(1), Abort("test", 0))
    assert readers[2].wait(10) and readers[2].take()
    assert not readers[0].take() and not readers[1].take()
    _until(lambda: watchers() - before == 3, "loan/, which only the closed readers read, no longer watched")
    readers[2].close()
    _until(lambda: watchers() == before, "every watch cancelled with its last reader")
    again = cluster.changes(FAILED())  # armed anew after its last reader went
    assert again.take() and not again.take()
    writer.create(FAILED(4), Failure(1, 0, "test"))
    assert again.wait(10) and again.take()
    again.close()


def test_readers_of_one_watch_are_all_told_it_was_lost_and_all_armed_again():
    with EtcdServer() as server:
        cluster = Cluster(server.endpoint, "shared-lost", patience=30)
        one, two = cluster.changes(FAILED()), cluster.changes(FAILED(), ABORT())
        one.take(), two.take()
        server.kill()
        _until(lambda: one.lost and two.lost, "both readers of the broken stream lost", timeout=60)
        server.start()
        cluster.create(FAILED(5), Failure(2, 0, "test"))  # written while no watch may be armed
        _until(lambda: (one.take(), two.take()) and not one.lost and not two.lost, "both armed again", timeout=60)
        assert etcd_counters(server.endpoint)[WATCHERS] == 2  # failed/ once, abort/
        cluster.create(FAILED(6), Failure(2, 0, "test"))
        assert one.wait(10) and one.take() and two.wait(10) and two.take()
