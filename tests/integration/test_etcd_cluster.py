"""An etcd of three members (bamboo/control/etcd.py EtcdCluster) under the
control plane's client: killing the leader costs a moment, never a key, a lease
or a watch; losing two of three pauses every request until one is back."""
import time

import pytest

from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdCluster, EtcdError, EtcdLost, check_member_count, parse_endpoints
from bamboo.control.keepalive import keepalives
from bamboo.control.protocol import ALIVE, FAILED, Alive, Failure

FAILURE_TIMEOUT = 3.0  # --failure-timeout's default: a failover must take well under it


@pytest.fixture
def members():
    with EtcdCluster.in_zones(3, ("a", "b", "c")) as cluster:
        yield cluster


def _until(predicate, timeout: float, what: str) -> float:
    """Seconds until predicate() holds (polled), or fail naming `what`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - start


def test_members_are_named_after_their_zones_and_listed_in_the_endpoints(members):
    assert [m.name for m in members.members] == ["bamboo-a", "bamboo-b", "bamboo-c"]
    assert len(parse_endpoints(members.endpoints)) == 3 and len({m.data_dir for m in members.members}) == 3


def test_the_client_fails_over_when_the_leader_dies(members):
    """The client talks to the leader (forced) when it dies: a put, a get, a lease
    refresh and the watch all work again on another member, each well within
    the failure timeout; the lease's age never looks like a dead node's."""
    cluster = Cluster(members.endpoints, "failover", patience=10)
    leader = members.leader()
    cluster.client._current_endpoint_label = members.members[leader].endpoint  # pyetcd's member in use
    lease = cluster.client.lease(15)
    cluster.put(ALIVE(0), Alive(0, lease.id), lease=lease)
    changes = cluster.changes(FAILED())
    assert changes.take() and not changes.lost
    killed = time.monotonic()
    members.kill(leader)
    cluster.create(FAILED(1), Failure(0, 0, "test"))  # retried until a live member with a leader takes it
    put = time.monotonic() - killed
    assert cluster.get(FAILED(1)) is not None  # (the time is printed: this machine may be loaded)
    refreshed = _until(lambda: _refreshes(lease), 10 * FAILURE_TIMEOUT, "a lease refresh")
    info = cluster.client.get_lease_info(lease.id)
    assert info.TTL > 0 and info.grantedTTL - info.TTL < FAILURE_TIMEOUT, "the new leader kept the lease"
    assert 0 in cluster.alive()
    rearmed = _until(lambda: (changes.take(), not changes.lost)[1], 10 * FAILURE_TIMEOUT, "the watch armed again")
    changes.take()
    cluster.create(FAILED(2), Failure(0, 0, "test"))
    assert changes.wait(FAILURE_TIMEOUT) and changes.take(), "the watch raised the flag on another member"
    assert members.leader() != leader
    print(f"put after {put:.2f} s, refresh after {refreshed:.2f} s, watch after {rearmed:.2f} s")
    cluster.close()


def _refreshes(lease) -> bool:
    try:
        return keepalives(lease.etcd_client).refresh(lease.id) > 0  # the heartbeat's own path
    except Exception:  # noqa: BLE001 -- no leader yet
        return False


def test_losing_two_of_three_pauses_and_one_back_resumes_with_nothing_lost(members):
    cluster = Cluster(members.endpoints, "quorum", patience=1)
    lease = cluster.client.lease(15)
    cluster.put(ALIVE(0), Alive(0, lease.id), lease=lease)
    survivor = members.leader()
    gone = [i for i in range(3) if i != survivor]
    for i in gone:
        members.kill(i)
    with pytest.raises(EtcdLost, match="did not answer"):  # no quorum: no write, no read
        cluster.create(FAILED(1), Failure(0, 0, "test"))
    members.restart(gone[0])
    cluster.patience = 10
    cluster.create(FAILED(1), Failure(0, 0, "test"))
    assert set(cluster.failed()) == {1} and cluster.alive() == {0}
    assert _until(lambda: _refreshes(lease), FAILURE_TIMEOUT, "a lease refresh") < FAILURE_TIMEOUT
    cluster.close()


@pytest.mark.parametrize("text", ["nonsense", "a:1,", "a:1,,b:2", ":1", "a:x", "a:0", "a:70000"])
def test_bad_endpoints_are_named(text):
    with pytest.raises(EtcdError, match=r"HOST:PORT\[,HOST:PORT\.\.\.\]"):
        parse_endpoints(text)


def test_good_endpoints_parse():
    assert parse_endpoints("10.0.0.1:2379, etcd-b:2379") == [("10.0.0.1", 2379), ("etcd-b", 2379)]


@pytest.mark.parametrize("count", [0, 2, 4, 9, -1])
def test_member_counts_other_than_1_3_5_7_are_refused(count):
    with pytest.raises(EtcdError, match="--etcd-members must be 1, 3, 5 or 7"):
        check_member_count(count)


def test_an_unreachable_cluster_is_one_clear_error():
    with pytest.raises(EtcdError, match="unreachable"):
        Cluster("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "x")
