"""The lease keep-alive stream (bamboo/control/keepalive.py) against a real etcd:
etcd's own view of each lease (LeaseTimeToLive) is the reference, and an etcd
killed and started again on the same ports is the broken stream."""
import threading
import time

import pytest

from bamboo.control.etcd import EtcdServer, connect, etcd_errors
from bamboo.control.keepalive import keepalives

TTL = 6


def _streams() -> int:
    return sum(t.name == "lease-keepalive" and t.is_alive() for t in threading.enumerate())


def _age(client, lease) -> int:
    info = client.get_lease_info(lease.id)
    return info.grantedTTL - info.TTL


def test_many_leases_share_one_stream_and_each_is_answered_for_itself():
    """Eight leases on one client, refreshed from eight threads at once for three
    seconds: etcd says none of them aged past a second, one stream carried them,
    and a lease left alone aged by the seconds that passed."""
    with EtcdServer() as etcd:
        client = connect(etcd.endpoint)
        before = _streams()
        kept, left = [client.lease(TTL) for _ in range(8)], client.lease(TTL)
        stop, ttls, errors = threading.Event(), {lease.id: [] for lease in kept}, []

        def keep(lease):
            while not stop.wait(0.2):
                try:
                    ttls[lease.id].append(keepalives(client).refresh(lease.id))
                except etcd_errors() as e:  # pragma: no cover -- printed by the assertion below
                    errors.append(e)
        threads = [threading.Thread(target=keep, args=(lease,)) for lease in kept]
        for t in threads:
            t.start()
        time.sleep(3)  # the lease left alone needs the seconds to pass: a duration under test
        ages = {lease.id: _age(client, lease) for lease in kept}
        stop.set()
        for t in threads:
            t.join()
        assert errors == []
        assert all(len(answers) >= 5 and set(answers) == {TTL} for answers in ttls.values()), ttls
        assert all(age <= 1 for age in ages.values()), ages
        assert _age(client, left) >= 2
        assert _streams() - before <= 1  # one stream carried all (another client's may end meanwhile)
        client.close()


def test_a_revoked_lease_is_answered_as_expired():
    with EtcdServer() as etcd:
        client = connect(etcd.endpoint)
        lease = client.lease(TTL)
        assert keepalives(client).refresh(lease.id) == TTL
        lease.revoke()
        assert keepalives(client).refresh(lease.id) <= 0
        client.close()


def test_a_broken_stream_fails_its_refresh_and_the_next_one_opens_a_new_stream():
    """etcd SIGKILLed: the refresh raises one of etcd's errors (the heartbeat's
    "try again next round"); etcd back on its ports with its leases: a refresh
    works again and etcd sees the lease refreshed."""
    with EtcdServer() as etcd:
        client = connect(etcd.endpoint, timeout=2.0)
        lease = client.lease(30)
        assert keepalives(client).refresh(lease.id) == 30
        etcd.kill()
        with pytest.raises(etcd_errors()):
            keepalives(client).refresh(lease.id)
        etcd.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert keepalives(client).refresh(lease.id) > 0
                break
            except etcd_errors():
                assert time.monotonic() < deadline, "no refresh went through after etcd came back"
                time.sleep(0.1)
        assert _age(client, lease) <= 1
        client.close()


def test_one_thread_keeps_every_heartbeat_of_a_client_and_a_halted_one_ages():
    """Eight heartbeats of one client: one beat thread (not one each) keeps each
    lease fresh in etcd's own view, each keeper hears its own replies, and the one
    halted is left to age, as a machine gone leaves its lease."""
    from bamboo.control.cluster import Cluster
    from bamboo.control.liveness import Heartbeat
    from bamboo.control.protocol import ALIVE, Alive
    with EtcdServer() as etcd:
        cluster = Cluster(etcd.endpoint, "beats")
        beats = sum(t.name == "lease-beat" and t.is_alive() for t in threading.enumerate())
        hearts = [Heartbeat(cluster, ALIVE(n), lambda lease, n=n: Alive(n, lease), ttl=TTL, failure_timeout=2.0)
                  for n in range(8)]
        assert sum(t.name == "lease-beat" and t.is_alive() for t in threading.enumerate()) - beats <= 1  # not 8
        hearts[3].halt()
        halted = time.monotonic()
        time.sleep(3)  # the halted lease needs the seconds to pass: a duration under test
        ages = {n: _age(cluster.client, h.lease) for n, h in enumerate(hearts)}
        assert ages[3] >= 2 and all(age <= 1 for n, age in ages.items() if n != 3), ages
        assert all(h.last_refresh > halted for n, h in enumerate(hearts) if n != 3)
        assert hearts[3].last_refresh <= halted
        for h in hearts:
            h.stop()
        cluster.close()


def test_a_patient_job_refreshes_less_and_its_lease_stays_young():
    """Heartbeats of one client at the default failure timeout (3 s: a refresh every
    0.5 s) and at 12 s (every 2 s): the patient one sends a quarter of the refreshes,
    and etcd's own view of its lease's age stays under its interval and a second, far
    from the timeout its peers judge by."""
    from bamboo.control.cluster import Cluster
    from bamboo.control.liveness import Heartbeat
    from bamboo.control.protocol import ALIVE, Alive
    with EtcdServer() as etcd:
        cluster = Cluster(etcd.endpoint, "patient")
        hearts = [Heartbeat(cluster, ALIVE(n), lambda lease, n=n: Alive(n, lease), ttl=60, failure_timeout=timeout)
                  for n, timeout in enumerate((3.0, 12.0))]
        counts, ages = [0, 0], []
        for n, heart in enumerate(hearts):
            heart.refreshed = lambda ttl, n=n, heard=heart.refreshed: (counts.__setitem__(n, counts[n] + 1), heard(ttl))
        deadline = time.monotonic() + 6  # a duration under test: refreshes are counted over it
        while time.monotonic() < deadline:
            ages.append(_age(cluster.client, hearts[1].lease))
            time.sleep(0.25)
        assert counts[1] >= 2 and counts[0] >= 2.5 * counts[1], counts
        assert max(ages) >= 1 and max(ages) <= hearts[1].refresh + 1 < 12, ages
        for h in hearts:
            h.stop()
        cluster.close()
