"""How often a node refreshes its lease, against what its peers and etcd require of it."""
from bamboo.control.config import JobConfig
from bamboo.control.keepalive import BEAT_SECONDS
from bamboo.control.liveness import refresh_seconds


def test_the_default_job_refreshes_at_every_beat():
    faults = JobConfig().faults
    assert refresh_seconds(faults.failure_timeout, faults.lease_ttl) == BEAT_SECONDS == 0.5


def test_a_lease_is_refreshed_often_enough_for_its_peers_and_for_etcd():
    """Over a grid of timeouts and TTLs: a live node's lease, refreshed this often, is
    never as old as the failure timeout (ages are whole seconds: one more than the
    interval at most) while the timeout allows it, nor near its TTL; and the interval
    grows with the timeout, so a patient job asks etcd less."""
    for timeout in (0.5, 1, 2, 3, 5, 7.5, 10, 30, 60, 300):
        for ttl in (2, 5, 15, 60, 600):
            every = refresh_seconds(timeout, ttl)
            beats = every / BEAT_SECONDS
            assert beats == int(beats) and beats >= 1
            if beats > 1:
                assert every <= timeout / 6 and every <= ttl / 3
            if timeout >= 3:
                assert every + 1 < timeout
    assert refresh_seconds(30, 15) == 5.0 and refresh_seconds(30, 600) == 5.0 and refresh_seconds(300, 15) == 5.0
    assert refresh_seconds(12, 60) == 2.0 > refresh_seconds(6, 60) == 1.0 > refresh_seconds(3, 60)
