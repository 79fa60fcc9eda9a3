"""Rollbacks without relaunch: when a stage is lost on every
node, the job goes back to the newest checkpoint from the copies peers keep in
host memory (bamboo/state/copies.py), from storage only when the live nodes'
copies do not cover every layer. Who keeps which copy, the agents' choice, and two
real jobs (real processes, real etcd, real SIGKILL) whose only pipeline loses two
neighbours at once: the survivors' workers stay up and the losses are the
single-process reference's (float64), from memory and, without copies, from storage."""
import random
import threading

import psutil
import pytest

from agents.membership import Membership
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ASSIGNMENT, COPIES, HANDOVER, PREEMPTED, START, Copies, Start
from bamboo.data.checkpoint_files import Attempt, LocalStorage, write_part
from bamboo.state.copies import holders, newest_covered
from tests.integration.test_faults import _finish, _node_processes, _start, _until, reference  # noqa: F401 (a fixture)
from tests.training import redos


@pytest.mark.parametrize("seed", range(30))
def test_two_neighbours_dying_leave_a_copy_of_every_stage(seed):
    """One pipeline of P >= 4 nodes (after any one earlier death in it that left no
    stage lost), any two neighbours (cyclically) killed: every stage's checkpoint
    is still in the memory of a live node, its writer or its holder. No holder is
    ever its stage's owner, or the owner of a neighbouring stage."""
    rng = random.Random(seed)
    P = rng.randint(4, 8)
    nodes = rng.sample(range(20), P)
    a = Assignment(0, 0, (tuple(nodes),))
    zones = {n: rng.choice("abc") for n in nodes}
    before = [] if rng.random() < 0.5 else [rng.choice(nodes)]
    kept = holders(a, before, zones)
    for stage, owner, holder in kept:
        assert holder not in {kept[(stage + d) % P][1] for d in (-1, 0, 1)}
    if before:
        return  # a pipeline after a failover: holders may be short (checked above only)
    for s in range(P):
        dead = {nodes[s], nodes[(s + 1) % P]}
        assert all({owner, holder} - dead - {None} for _, owner, holder in kept), (nodes, dead, kept)


def test_a_holder_in_another_zone_is_preferred():
    a = Assignment(0, 0, ((0, 1, 2, 3, 4, 5),))
    zones = {0: "a", 1: "b", 2: "a", 3: "a", 4: "c", 5: "b"}
    assert holders(a, (), zones)[0] == (0, 0, 4)  # 2 and 3 share zone a with the owner; 1 and 5 are its neighbours
    lone = Assignment(0, 0, ((0, 1, 2),))  # three stages: every node is a neighbour
    assert [h for _, _, h in holders(lone, (), zones)] == [None] * 3
    two = Assignment(0, 0, ((0, 1, 2), (3, 4, 5)))  # ... unless another pipeline has nodes
    assert all(h in (3, 4, 5) for _, _, h in holders(two, (), zones))


def test_a_holder_in_a_third_zone_survives_a_burst_of_the_owner_s_and_the_replica_s_zones():
    """Stage 1's owner (node 1) is in zone b and its replica's holder (node 0) in a: of
    the other pipeline, node 3 is in a and node 4 in c. The copy goes to c, so a burst
    of zones a and b leaves it."""
    a = Assignment(0, 0, ((0, 1, 2), (3, 4, 5)))
    zones = {0: "a", 1: "b", 2: "c", 3: "a", 4: "c", 5: "b"}
    kept = holders(a, (), zones)
    for stage, owner, holder in kept:  # by brute force: a third zone whenever the candidates have one
        replica = kept[(stage - 1) % 3][1]
        third = [n for n in (3, 4, 5) if zones[n] not in (zones[owner], zones[replica])]
        assert zones[holder] not in (zones[owner], zones[replica]) if third else zones[holder] != zones[owner]
    assert kept[1] == (1, 1, 4)
    burst = {n for n, z in zones.items() if z in "ab"}
    assert {1, 4} - burst == {4}


def test_the_newest_iteration_the_live_copies_cover():
    records = {0: Copies(6, (0, 1)), 1: Copies(6, (2, 3)), 2: Copies(4, (0, 1, 2)), 3: Copies(4, (3,))}
    assert newest_covered(records, {0, 1, 2, 3}, 4, at_most=9) == 6
    assert newest_covered(records, {0, 2, 3}, 4, at_most=9) == 4   # node 1 died: 6 is not whole
    assert newest_covered(records, {0, 1, 2, 3}, 4, at_most=5) == 4  # 6 is from an earlier run of 5
    assert newest_covered(records, {0, 2}, 4, at_most=9) is None


class _Agent:
    def __init__(self, cluster):
        self.cluster = cluster


def test_the_agents_prefer_memory_unless_storage_is_newer(etcd, tmp_path):
    """restore "memory" when the live copies cover a checkpoint at least as new as
    storage's newest complete one; "checkpoint" otherwise; "initial" with neither."""
    cluster = Cluster(etcd.endpoint, "restore-point")
    cluster.put(START(), Start(0))
    cfg = JobConfig.of(layers=4, checkpoint=str(tmp_path / "ckpt"))
    storage = LocalStorage(cfg.checkpoints.checkpoint)

    def point(start, live):
        return Membership._restore_point(_Agent(cluster), cfg, start, live)
    assert point(9, {0, 1}) == (0, "initial")
    write_part(storage, Attempt(4, "run-e000000"), 0, {i: b"x%d" % i for i in range(4)}, layers=4)
    assert point(9, {0, 1}) == (4, "checkpoint")
    cluster.put(COPIES(0), Copies(4, (0, 1)))
    cluster.put(COPIES(1), Copies(4, (2, 3)))
    assert point(9, {0, 1}) == (4, "memory")
    assert point(9, {0}) == (4, "checkpoint")  # node 1 died: its copies with it
    write_part(storage, Attempt(6, "run-e000000"), 0, {i: b"y%d" % i for i in range(4)}, layers=4)
    assert point(9, {0, 1}) == (6, "checkpoint")  # storage has a newer one (a copy exchange failed, say)
    assert point(5, {0, 1}) == (4, "memory")


# One pipeline of four (the policy lays it out (0, 1, 3, 2) over zones a, b, c), a
# checkpoint every two iterations; stages 1 and 2 die at once in iteration 5, so
# stage 2 is lost everywhere and the job goes back to the checkpoint taken before 4.
JOB = ["--local-nodes", "4", "--zones", "a,b,c", "--stages", "4", "--max-stages-per-node", "1", "--surplus", "keep",
       "--checkpoint-every", "2", "--preempt", "1@5:3", "--preempt", "3@5:3"]


def _watch_workers(proc, seen: dict, stop: threading.Event) -> None:
    """node -> the pids of its worker processes, sampled until the job ends."""
    while not stop.is_set() and proc.poll() is None:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:  # the job ended between the poll and this read
            break
        for p in children:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "bamboo.runtime.worker" in cmd:
                seen.setdefault(int(cmd[cmd.index("--node") + 1]), set()).add(p.pid)
        stop.wait(0.25)  # a restarted worker would live for seconds


def _rollback(tmp_path, reference, memory: bool):
    """Run the job; return its redo events and the pids each node's worker had."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    seen, stop = {}, threading.Event()
    with EtcdServer() as etcd:
        proc = _start(etcd, metrics, *JOB, "--checkpoint", str(ckpt), *([] if memory else ["--no-memory-copies"]))
        watcher = threading.Thread(target=_watch_workers, args=(proc, seen, stop), daemon=True)
        watcher.start()
        cluster = Cluster(etcd.endpoint, "faults")
        _until(proc, lambda: list(ckpt.glob("ckpt-00000004-*/commit.json")), "checkpoint 4")
        assert cluster.get(ASSIGNMENT(0)).pipelines == ((0, 1, 3, 2),)
        if memory:  # storage loses it: only the copies in memory can bring it back
            ckpt.rename(tmp_path / "moved")
            assert not cluster.children(PREEMPTED()), "the kill came before the checkpoint was moved away"
        try:
            records = _finish(proc, metrics, reference)
        finally:
            stop.set()
            watcher.join()
    return redos(records), seen


@pytest.mark.slow  # make test-slow: 45 s here (make test keeps the quicker rollback cases)
def test_two_neighbours_killed_roll_back_from_peers_memory(tmp_path, reference):
    redo, workers = _rollback(tmp_path, reference, memory=True)
    assert redo == [{"type": "redo", "abandoned": 5, "from": 4, "restore": "memory"}]
    assert len(workers[0]) == len(workers[2]) == 1  # the survivors' workers were never restarted


# in make test: the one restore from storage there (test_agents' is in make test-slow)
@pytest.mark.slow
def test_without_copies_the_rollback_reads_storage(tmp_path, reference):
    redo, workers = _rollback(tmp_path, reference, memory=False)
    assert redo == [{"type": "redo", "abandoned": 5, "from": 4, "restore": "checkpoint"}]
    assert len(workers[0]) == len(workers[2]) == 1


@pytest.mark.slow  # make test-slow: keeps make test under 15 min on a 2-core machine
def test_a_copy_holder_killed_in_the_rollback_sends_it_to_storage(tmp_path, reference):
    """Five nodes: the pipeline (0, 1, 3, 2) and node 4 in standby. Stages 1 and 2
    die in iteration 5; the agents go back to checkpoint 4 from memory (node 0
    keeps stages 0 and 2, node 2 stages 3 and 1). Node 2 is killed as soon as that
    epoch is written: its handover fails, and the next epoch, node 0's copies no
    longer covering every layer, reads checkpoint 4 from storage."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    with EtcdServer() as etcd:
        proc = _start(etcd, metrics, *JOB, "--local-nodes", "5", "--checkpoint", str(ckpt))
        cluster = Cluster(etcd.endpoint, "faults")
        rollback = _until(proc, lambda: cluster.get(ASSIGNMENT(1)), "the rollback's epoch")
        for p in _node_processes(proc, 2):
            p.send_signal(9)
        assert rollback.restore == "memory" and cluster.get(ASSIGNMENT(0)).pipelines == ((0, 1, 3, 2),)
        records = _finish(proc, metrics, reference)
        assert not cluster.get(HANDOVER(1)).complete
    redo = redos(records)
    assert [(e["from"], e["restore"]) for e in redo][-1] == (4, "checkpoint"), redo
