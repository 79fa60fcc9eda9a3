"""bamboo/control/changes.py against a real etcd: the flag a watch raises, and what a
reader sees when etcd restarts under the watch (it must never miss a change)."""
import time

from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ABORT, FAILED, FINISHED, Abort, Failure, Finished, Mark


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
