"""The etcd pieces against a real etcd server: the torch Store, the cluster keys,
and the arithmetic that turns survivors' message counts into the failure point."""
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from schedules import ir

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.etcd import EtcdCluster, EtcdError, EtcdServer, connect
from bamboo.control.protocol import ALIVE, FAILED, Failure
from bamboo.control.store import EtcdStore
from bamboo.runtime.failover import Unsurvivable, died_before
from schedules.options import ScheduleOptions


def test_store_semantics(etcd):
    store = EtcdStore(connect(etcd.endpoint), "/t/store", timedelta(seconds=1))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"x") == b"x"       # absent: created
    assert store.compare_set("c", b"y", b"z") == b"x"      # mismatch: unchanged
    assert store.compare_set("c", b"x", b"z") == b"z"
    assert store.check(["a", "c"]) and not store.check(["missing"])
    assert store.delete_key("a") and not store.check(["a"])
    with pytest.raises(TimeoutError, match="missing"):
        store.wait(["missing"], timedelta(seconds=0.2))


def test_a_store_wait_outlasts_an_etcd_restart():
    """Chaos seed 1 once ended a job: a rendezvous wait asked etcd while it
    restarted. With the cluster's retry, the wait carries on and ends once the
    key is set after the restart."""
    with EtcdServer() as server:
        cluster = Cluster(server.endpoint, "job")
        store = EtcdStore(cluster.client, "/t/restart", timedelta(seconds=30), retry=cluster.call)
        server.kill()
        waited = []
        waiter = threading.Thread(target=lambda: waited.append(store.wait(["k"]) or "done"), daemon=True)
        waiter.start()
        server.start()
        connect(server.endpoint).put("/t/restart/k", b"1")
        waiter.join(timeout=30)
        assert waited == ["done"]


def test_gloo_group_rendezvous_through_the_store(etcd):
    """A one-member gloo group built on the etcd store works (the real use)."""
    store = EtcdStore(connect(etcd.endpoint), "/t/pg")
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
    import torch
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_first_writer_wins_and_leases_expire(etcd):
    a, b = Cluster(etcd.endpoint, "job1"), Cluster(etcd.endpoint, "job1")
    assert a.create(FAILED(3), Failure(0, 1)) and not b.create(FAILED(3), Failure(0, 2))
    assert b.get(FAILED(3)) == Failure(0, 1) and b.children(FAILED()) == {3: Failure(0, 1)}
    assert Cluster(etcd.endpoint, "job2").get(FAILED(3)) is None  # jobs do not see each other's keys
    a.register(5, JobConfig.of(lease_ttl=2), on_fenced=print)
    assert 5 in b.alive() and b.get(ALIVE(5)).lease == a.heartbeat.lease.id
    a.heartbeat.stop()
    assert 5 not in b.alive() and b.silent([5]) == [5]


def test_unreachable_etcd_is_one_clear_error():
    with pytest.raises(EtcdError, match="unreachable"):
        connect("127.0.0.1:1", timeout=1)
    with pytest.raises(EtcdError, match="HOST:PORT"):
        connect("localhost")


def test_died_before_from_message_counts():
    stream = [ir.recv_act(0, 0, 0), ir.forward(1, 0), ir.send_act(1, 0, 2), ir.recv_act(0, 1, 0),
              ir.forward(1, 1), ir.send_act(1, 1, 2), ir.recv_grad(2, 0, 2), ir.backward(1, 0),
              ir.send_grad(1, 0, 0)]
    assert died_before(stream, {}) == 0
    assert died_before(stream, {2: {"send_act": 1}}) == 3
    assert died_before(stream, {2: {"send_act": 2}}) == 6
    assert died_before(stream, {2: {"send_act": 2}, 0: {"send_grad": 1}}) == 9
    with pytest.raises(Unsurvivable, match="out of order"):
        died_before(stream, {2: {"send_act": 1}, 0: {"send_grad": 1}})


def test_a_late_sync_overtaken_by_later_sends_is_judged_alone():
    """--replica-sync next: the sync of the iteration before leads the stream on a
    channel of its own, so later sends may land before it. Landed, it counts as
    run; not landed, the holder's replica is a step behind, whatever came after."""
    stream = [ir.send_sync(1, 0), ir.recv_act(0, 0, 0), ir.forward(1, 0), ir.send_act(1, 0, 2)]
    assert died_before(stream, {0: {"send_sync": 1}}, late=True) == 1
    assert died_before(stream, {0: {"send_sync": 1}, 2: {"send_act": 1}}, late=True) == 4
    with pytest.raises(Unsurvivable, match="had not arrived: that replica of its stage is then a step behind"):
        died_before(stream, {2: {"send_act": 1}}, late=True)
    with pytest.raises(Unsurvivable, match="a step behind"):
        died_before(stream, {}, late=True)
    with pytest.raises(Unsurvivable, match="out of order"):  # the sync at the end is ordered with the rest
        died_before(stream, {2: {"send_act": 1}})


def _failover(P=4, M=4):
    from schedules.compiler import compile_schedule

    from bamboo.runtime.failover import Failover
    from bamboo.runtime.watch import Watch
    f = Failover(None, tuple(range(P)), 0, 0, ScheduleOptions(redundancy="eager"), JobConfig())
    f.now = Watch(iteration=5, microbatches=M, failed=(), comm=None, streams=compile_schedule(P, M).streams)
    return f


def test_a_failure_the_schedules_cannot_absorb_is_unsurvivable_by_its_reason():
    f = _failover()
    f.options = f.options.with_(redundancy="off")  # no node holds a replica of node 3's layers
    with pytest.raises(Unsurvivable, match="not survivable with --redundancy off"):
        f._recovery(3, {})


def test_an_internal_error_in_recovery_is_a_bug_with_its_state(monkeypatch):
    from bamboo.runtime import failover
    f = _failover()

    def broken(*args, **options):
        raise KeyError("stage 7")
    monkeypatch.setattr(failover, "compile_recovery", broken)
    with pytest.raises(failover.RecoveryBug, match=r"node 2 .* iteration 5: P=4 M=4 failed=\(\) .*KeyError"):
        f._recovery(2, {})
    assert not issubclass(failover.RecoveryBug, RuntimeError)  # never taken for a peer's failure


def test_create_unless_writes_only_while_the_other_key_is_absent(etcd):
    c = Cluster(etcd.endpoint, "job")
    assert c.create_unless(FAILED(1), Failure(0, 2), unless=FAILED(9))
    assert not c.create_unless(FAILED(1), Failure(5, 5), unless=FAILED(9))  # exists: the first stands
    c.create(FAILED(9), Failure(0, 0))
    assert not c.create_unless(FAILED(2), Failure(0, 0), unless=FAILED(9))
    assert c.get(FAILED(1)) == Failure(0, 2) and c.get(FAILED(2)) is None


def test_a_redo_clears_any_number_of_iterations_in_one_transaction(etcd):
    """Chaos seed 24: going back 30 iterations once needed 480 operations in one
    transaction (etcd allows 128). Now one range per family: every key of
    iterations 3..33 goes, those before and after stay (checked key by key)."""
    from bamboo.control.assignment import Assignment
    from bamboo.control.protocol import ASSIGNMENT, DONE, ITERATION_FAMILIES, LOSS, Loss, Report
    c = Cluster(etcd.endpoint, "job")
    for it in range(40):
        for node in (0, 1, 10):
            c.put(DONE(it, node), Report(rss_mb=0.0, time=0.0, epoch=0))
        c.put(LOSS(it, 7), Loss(1.0))
    clear = [(family(3), family(34)) for family in ITERATION_FAMILIES]
    assert c.create_clearing(ASSIGNMENT(1), Assignment(1, 3, ((0, 1),)), clear)
    assert sorted(c.children(LOSS())) == [(it, 7) for it in range(40) if not 3 <= it <= 33]
    assert sorted(c.children(DONE())) == [(it, n) for it in range(40) if not 3 <= it <= 33 for n in (0, 1, 10)]


def test_a_process_started_while_etcd_restarts_waits_for_it():
    """Chaos seed 56: an agent restarted its worker while etcd was down; the
    worker's first connection failed and the job ended. Workers and agents
    (wait=True) try for the patience; a command (status, the launcher) fails at once."""
    with EtcdServer() as server:
        server.kill()
        with pytest.raises(EtcdError):
            Cluster(server.endpoint, "job", patience=30)
        got = []
        starter = threading.Thread(target=lambda: got.append(Cluster(server.endpoint, "job", patience=30, wait=True)))
        starter.start()
        server.start()
        starter.join(timeout=60)
        assert got and got[0].create(FAILED(1), Failure(0, 0))


FORK_WHILE_CONNECTING = """
import subprocess, threading
from bamboo.control.etcd import EtcdError, connect, die_with_parent, free_port
endpoint, stop = f"127.0.0.1:{free_port()}", threading.Event()
def keep_connecting():
    while not stop.is_set():
        try:
            connect(endpoint, timeout=0.2)
        except EtcdError:
            pass
threads = [threading.Thread(target=keep_connecting) for _ in range(2)]
for t in threads:
    t.start()
codes = [subprocess.run(["true"], preexec_fn=die_with_parent).returncode for _ in range(100)]
stop.set()
print("exit codes", sorted(set(codes)))
"""


def test_children_forked_while_grpc_connects_run_no_grpc_code():
    """CI: etcd started while another thread connected aborted in gRPC's fork
    handler ("Check failure") before it could exec. Bamboo turns the handlers off;
    with them on, gRPC logs from fork_posix.cc at nearly every such fork."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FORK_WHILE_CONNECTING], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "exit codes [0]" in run.stdout
    assert "fork_posix" not in run.stderr, run.stderr[-2000:]


def _taken(port: int):
    """A socket that holds `port` on loopback, as another process would."""
    import socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a killed server's TIME_WAIT
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_first_start_whose_port_was_taken_meanwhile_moves_and_a_restart_keeps_its_ports():
    """The embedded etcd picks free ports and binds them a moment later; a process
    that took one meanwhile made a test fail once ("address already in use"). A
    first start tries fresh ports. A restart must come back where clients look."""
    server = EtcdServer()
    picked = server.port
    holder = _taken(picked)
    try:
        server.start()
        assert server.port != picked
        connect(server.endpoint).put("/t/moved", b"1")
        server.kill()
        server.start()  # back on the same port, with the key
        assert connect(server.endpoint).get("/t/moved")[0] == b"1"
        moved = server.port
        server.kill()
        with _taken(moved):
            with pytest.raises(EtcdError, match="address already in use"):
                server.start()
    finally:
        holder.close()
        server.stop()


def test_a_cluster_whose_port_was_taken_meanwhile_starts_on_fresh_ones():
    cluster = EtcdCluster(["a", "b", "c"])
    picked = cluster.members[1].peer_port
    holder = _taken(picked)
    try:
        with cluster:
            assert picked not in [p for m in cluster.members for p in (m.port, m.peer_port)]
            assert cluster.members[0].peers.count("http://") == 3 and str(picked) not in cluster.members[0].peers
            connect(cluster.endpoints).put("/t/cluster", b"1")
            assert connect(cluster.members[2].endpoint).get("/t/cluster")[0] == b"1"
    finally:
        holder.close()


def test_a_scratch_etcd_skips_the_disk_sync_and_still_keeps_every_write_across_a_sigkill(tmp_path):
    """A lone member on a data dir of its own runs without fsync (its dir goes when it
    stops); what it acknowledged is in the kernel's hands, so a SIGKILL of etcd loses
    none of it. A member on a given data dir keeps the sync."""
    def flags(server):
        return open(f"/proc/{server.proc.pid}/cmdline", "rb").read().split(b"\0")
    with EtcdServer() as server, EtcdServer(data_dir=str(tmp_path)) as kept:
        assert server.scratch and b"--unsafe-no-fsync" in flags(server)
        assert not kept.scratch and b"--unsafe-no-fsync" not in flags(kept)
        client = connect(server.endpoint)
        for i in range(50):
            client.put(f"/t/k{i}", str(i))
        client.close()
        server.kill()
        server.start()
        values = {int(v) for v, _ in connect(server.endpoint).get_prefix("/t/")}
        assert values == set(range(50))


def test_the_newest_epoch_read_alone_is_the_newest_of_all_read(etcd):
    """Cluster.latest_assignment reads one record: the same as the newest of every
    epoch read (the brute force), past epochs 9 -> 10 -> 100 (key order is number
    order), with a stray non-numeric key under the family left out."""
    from bamboo.control.assignment import Assignment
    from bamboo.control.cluster import latest
    from bamboo.control.protocol import ASSIGNMENT
    c = Cluster(etcd.endpoint, "newest")
    with pytest.raises(RuntimeError, match="no assignment"):
        c.latest_assignment()
    c.client.put(c.key(ASSIGNMENT()) + "/zzz", b"{}")  # sorts after every number
    for epoch in (0, 1, 9, 10, 100):
        c.put(ASSIGNMENT(epoch), Assignment(epoch, epoch * 3, ((0, 1), (2, 3))))
        assert c.latest_assignment() == latest({e: a for e, a in c.read_spans((ASSIGNMENT(0), ASSIGNMENT(1000)))[0]
                                                .items()}) == c.get(ASSIGNMENT(epoch))


def test_a_look_reads_the_iteration_abort_with_the_deaths_in_one_transaction(etcd):
    """read_with_aborts: the aborts of the iterations asked (not the one before or
    after) and the prefixes' children, as separate reads give them."""
    from bamboo.control.protocol import ABORT, REGROUP, Abort, Regroup
    c = Cluster(etcd.endpoint, "looks")
    c.create(FAILED(4), Failure(6, 1, "test"))
    c.create(ABORT(5), Abort("before", 1))
    c.create(ABORT(7), Abort("after", 1))
    c.create(REGROUP(6, 0), Regroup((4,), True, False))
    assert c.read_with_aborts(range(6, 7), REGROUP(6), FAILED()) == ({}, c.children(REGROUP(6)), c.failed())
    c.create(ABORT(6), Abort("this one", 2))
    aborts, failed = c.read_with_aborts(range(6, 7), FAILED())
    assert aborts == {6: c.get(ABORT(6))} == {6: Abort("this one", 2)} and failed == {4: Failure(6, 1, "test")}
    assert c.read_with_aborts(range(6, 8))[0] == {6: Abort("this one", 2), 7: Abort("after", 1)}


def test_a_watched_wait_reads_again_when_its_watch_fires_not_at_each_poll(etcd):
    """wait_for with a watch of what the predicate reads: the write made after the
    first read ends the wait (its poll, longer than its timeout, never would), and
    the predicate ran once per change, not in a poll loop."""
    from bamboo.control.protocol import ABORT, Abort
    c = Cluster(etcd.endpoint, "watched")
    watch, calls = c.changes(ABORT()), []

    def predicate():
        calls.append(1)
        if len(calls) == 1:
            threading.Thread(target=c.create, args=(ABORT(3), Abort("now", 1))).start()
        return c.get(ABORT(3))
    assert c.wait_for(predicate, timeout=20, what="the abort", poll=60, changes=watch) == Abort("now", 1)
    assert len(calls) <= 3  # the first read, the wake (the watch's first arming may add one)
    watch.close()


class _NoPlane:
    """A data plane with nothing on it: a Failover's begin asks only its counts."""

    def counts(self) -> dict:
        return {}


def test_a_failover_begins_an_iteration_on_the_last_look_which_read_the_next_abort_too(etcd):
    """A look reads this iteration's abort and the next one's: the next iteration
    begins on what it read while the watch says nothing changed (no read), and an
    abort of the next iteration posted before that look is its event at once."""
    from bamboo.control.protocol import ABORT, LOAN, Abort
    from bamboo.runtime.failover import Failover
    from bamboo.runtime.watch import AbortPosted, Watches
    c = Cluster(etcd.endpoint, "next-abort")
    looks = []
    read = c.read_with_aborts
    c.read_with_aborts = lambda *a: (looks.append(a[0]), read(*a))[1]
    f = Failover(c, (0, 1, 2), 0, 0, ScheduleOptions(redundancy="eager"), JobConfig.of(elastic=True),
                 Watches(c.changes(FAILED(), ABORT(), LOAN()), c.changes(FAILED(), ABORT())))
    for it in (4, 5):
        f.begin(it, 3, (), _NoPlane())
        assert f.poll() is None
    assert looks == [range(4, 6)]  # iteration 5 began on iteration 4's look
    c.create(ABORT(7), Abort("a pipeline of iteration 7 could not finish", 2))
    assert f.failures.flag.wait(30)  # the watch saw it
    f.begin(6, 3, (), _NoPlane())
    assert f.poll() is None and looks[-1] == range(6, 8)  # the watch fired: a look, which read abort 7
    f.begin(7, 3, (), _NoPlane())
    assert f.poll() == AbortPosted("a pipeline of iteration 7 could not finish") and len(looks) == 2
