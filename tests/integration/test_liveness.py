"""Liveness against a real etcd (bamboo/control/liveness.py): a paused process is found
silent within the failure timeout, while a stalled etcd (SIGSTOP of the server)
condemns no one; a lease that expired anyway is taken again, or, when the node was
recorded dead meanwhile, the node is told why it must stop."""
import queue
import signal
import subprocess
import sys
import time

import pytest

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.etcd import EtcdServer
from bamboo.control.liveness import HANG_FLOOR, hang_deadline
from bamboo.control.exits import Fenced
from bamboo.control.protocol import ABORT, ALIVE, FAILED, LOSS, MEMBERS, Abort, Alive, Failure, Loss, Member, Report
from bamboo.runtime.boundary import stragglers

CFG = JobConfig.of(failure_timeout=2.0, lease_ttl=15.0)

CHILD = """
import sys, time
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
c = Cluster(sys.argv[1], "live")
c.register(int(sys.argv[2]), JobConfig.of(failure_timeout=2.0, lease_ttl=15.0), on_fenced=print)
print("registered", flush=True)
time.sleep(600)
"""


def _registered_child(endpoint: str, node: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, str(node)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "registered"
    return child


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return time.monotonic()


@pytest.fixture
def server():
    with EtcdServer() as etcd:
        yield etcd


def test_a_paused_process_is_silent_within_the_failure_timeout_and_not_before(server):
    me = Cluster(server.endpoint, "live")
    me.register(1, CFG, on_fenced=print)
    child = _registered_child(server.endpoint, 7)
    try:
        _until(me.heartbeat.judging, 10, "the observer never became able to judge")
        assert me.silent([7]) == []
        child.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        found = _until(lambda: me.silent([7]) == [7], 10, "a stopped process was never found silent")
        # etcd counts whole seconds and the last refresh came up to 0.5 s before the stop
        assert CFG.faults.failure_timeout - 0.6 <= found - stopped <= CFG.faults.failure_timeout + 2
        assert 7 in me.alive()  # its key is still there: the lease itself has not expired
        child.send_signal(signal.SIGCONT)
        _until(lambda: me.silent([7]) == [], 5, "a resumed process stayed silent")
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # tests/integration/test_faults.py stalls etcd under a running job in make test
def test_a_ten_second_etcd_stall_condemns_no_one(server):
    """Both nodes keep their leases through a 10 s SIGSTOP of etcd, and neither
    finds the other silent at any moment after it."""
    me = Cluster(server.endpoint, "live")
    me.register(1, CFG, on_fenced=print)
    child = _registered_child(server.endpoint, 7)
    try:
        _until(me.heartbeat.judging, 10, "the observer never became able to judge")
        lease = me.heartbeat.lease.id
        server.proc.send_signal(signal.SIGSTOP)
        time.sleep(10)  # the stall under test is a duration, not an event
        server.proc.send_signal(signal.SIGCONT)
        end = time.monotonic() + CFG.faults.failure_timeout + 3
        while time.monotonic() < end:
            assert me.silent([1, 7]) == []
            time.sleep(0.1)
        assert me.heartbeat.lease.id == lease and {1, 7} <= me.alive()
    finally:
        server.proc.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def test_an_expired_lease_is_taken_again_unless_the_node_was_recorded_dead(server):
    reasons: queue.Queue = queue.Queue()
    short = JobConfig.of(failure_timeout=1.0, lease_ttl=2.0)
    a, b = Cluster(server.endpoint, "live"), Cluster(server.endpoint, "live")
    a.register(1, short, on_fenced=reasons.put)
    b.register(2, short, on_fenced=reasons.put)
    old = a.heartbeat.lease.id
    b.create(FAILED(2), Failure(4, 1, "test"))
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(4)  # longer than the TTL: every lease expires when etcd resumes
    server.proc.send_signal(signal.SIGCONT)
    assert "recorded dead in iteration 4 by node 1" in reasons.get(timeout=15)
    _until(lambda: a.get(ALIVE(1)) is not None and a.get(ALIVE(1)).lease != old, 15,
           "node 1 did not register again")
    assert reasons.empty()


def test_silence_read_key_by_key_for_a_few_nodes_and_by_family_for_many_agrees_with_brute_force(server):
    """Workers registered on even ids, agents on every third: a pipeline's few peers
    (read key by key) and the whole job (read by family) are each judged as a
    brute force over both families says."""
    c = Cluster(server.endpoint, "spans")
    lease = c.client.lease(15)
    workers, agents = set(range(0, 150, 2)), set(range(0, 150, 3))
    c.put_all({ALIVE(n): Alive(n, lease.id) for n in workers})
    c.put_all({MEMBERS(n): Member("a", "h", lease.id) for n in agents})

    def brute(nodes, starting):
        return sorted(n for n in nodes if n not in workers and not (n in starting and n in agents))
    for nodes, starting in (([1, 2, 3, 9, 10], ()), ([1, 2, 3, 9, 10], (3, 9, 11)), ([7], (7,)),
                            (list(range(150)), ()), (list(range(150)), range(0, 150, 5)), ([], ())):
        assert c.silent(nodes, starting) == brute(nodes, set(starting)), (nodes, starting)


def _report(busy: float, events=()) -> Report:
    return Report(rss_mb=0.0, time=0.0, epoch=0, events=list(events), busy=busy)


def test_a_straggler_is_judged_against_its_peers_median():
    """Brute-force reading of the rule: slower than both factor x the median of the
    others and that median plus the slack."""
    reports = {0: _report(1.0), 1: _report(1.2), 2: _report(11.0), 3: _report(0.9)}
    assert stragglers(reports, factor=5, slack=3) == [2]
    assert stragglers(reports, factor=0, slack=3) == []             # off
    assert stragglers(reports, factor=5, slack=20) == []            # within the slack
    assert stragglers({0: _report(0.01), 1: _report(0.2)}, 5, 3) == []  # 20x, but 0.19 s: noise
    assert stragglers({0: _report(1.0), 1: _report(10.0)}, 5, 3) == [1]  # two nodes: each against the other
    reports[1] = _report(1.2, events=[{"type": "failover"}])
    assert stragglers(reports, 5, 3) == []  # a takeover computes more: not judged


def test_the_hang_deadline_follows_the_running_median_within_its_bounds():
    assert hang_deadline([], cap=300) == 300                      # before any iteration: --hang-timeout
    assert hang_deadline([0.5] * 30, cap=300) == HANG_FLOOR       # fast iterations: never under the floor
    assert hang_deadline([1.0] * 5 + [20.0] * 20, cap=300) == 200  # ten medians of the recent ones
    assert hang_deadline([20.0] * 9 + [900.0], cap=300) == 200     # one slow iteration moves no median
    assert hang_deadline([40.0] * 10, cap=300) == 300              # never over --hang-timeout


def test_a_node_recorded_dead_is_told_at_once_and_etcd_refuses_its_writes(server):
    """Recording a death revokes the node's lease: its heartbeat stops it at the next
    refresh (no TTL to wait out), and every write of its old incarnation, however
    late, is refused by etcd itself; its key never comes back under that id."""
    reasons: queue.Queue = queue.Queue()
    old, peer = Cluster(server.endpoint, "fence"), Cluster(server.endpoint, "fence")
    long = JobConfig.of(failure_timeout=2.0, lease_ttl=60.0)  # only the revocation can tell it within 15 s
    old.register(3, long, on_fenced=reasons.put)
    peer.register(4, long, on_fenced=reasons.put)
    assert peer.record_dead(3, Failure(6, 4, "test"))
    assert "node 3 was recorded dead in iteration 6 by node 4 (test)" in reasons.get(timeout=15)
    assert peer.get(ALIVE(3)) is None and peer.get(ALIVE(4)) is not None
    with pytest.raises(Fenced, match="etcd refused a write"):
        old.put(LOSS(6, 0), Loss(1.0))
    with pytest.raises(Fenced):
        old.create(ABORT(6), Abort("test", 3))
    with pytest.raises(Fenced):
        old.heartbeat._take_lease()  # the re-registration a partition's end would try
    assert peer.get(LOSS(6, 0)) is None and peer.get(ABORT(6)) is None and peer.get(ALIVE(3)) is None
    peer.put(LOSS(6, 1), Loss(2.0))  # the living write as before
    assert reasons.empty()


def test_a_write_refused_by_its_own_condition_is_told_from_a_fence_in_one_round_trip(server):
    """A guarded write whose own condition fails (the key exists) is not taken for
    the writer's fence, and a fenced writer's is: the transaction reads the fence
    itself, so neither asks etcd again."""
    live, peer = Cluster(server.endpoint, "told"), Cluster(server.endpoint, "told")
    live.fenced_as, peer.fenced_as = 3, 4
    assert peer.create_or_get(ABORT(2), Abort("first", 4)) == (Abort("first", 4), True)
    calls = []
    get = live.client.get
    live.client.get = lambda *a, **k: calls.append(a) or get(*a, **k)
    assert live.create_or_get(ABORT(2), Abort("second", 3)) == (Abort("first", 4), False)
    assert calls == []  # the refusal needed no second request
    assert peer.record_dead(3, Failure(2, 4, "test"))
    with pytest.raises(Fenced, match="node 3 was recorded dead in iteration 2 by node 4"):
        live.create_or_get(ABORT(2), Abort("third", 3))


def test_a_peer_seen_fresh_is_not_asked_again_until_it_may_be_stale(server):
    """A lease's age grows by at most the seconds since it was read: with a 10 s
    failure timeout, a peer whose lease was just refreshed is asked once in a
    second of looks (every 0.25 s before), and its silence is still found."""
    me = Cluster(server.endpoint, "live")  # the child registers in job "live"
    me.register(1, JobConfig.of(failure_timeout=10.0, lease_ttl=15.0), on_fenced=print)
    child = _registered_child(server.endpoint, 7)
    try:
        me.heartbeat.fresh_since -= 60  # this node judges (its own refreshes came for long enough)
        asks, info = [], me.client.get_lease_info
        me.client.get_lease_info = lambda lease: asks.append(lease) or info(lease)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert me.silent([7]) == []
            time.sleep(0.05)
        assert len(asks) == 1
        child.send_signal(signal.SIGSTOP)
        _until(lambda: me.silent([7]) == [7], 20, "a stopped process was never found silent")
    finally:
        child.kill()
        child.wait()
