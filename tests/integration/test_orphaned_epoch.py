"""The agents' decision when every member of the epoch in force is gone before
any could write an abort or a regroup (keys only workers write): on a real etcd,
two standby agents record the members dead and write the redo epoch over
themselves (chaos seeds 27 and 34 waited out their 600 s here); while a member's
worker runs, or an agent of a member still starts its worker, they do nothing."""
import contextlib
import dataclasses

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import (ABORT, ABORTED, ALIVE, ASSIGNMENT, CONFIG, DONE, FAILED, MEMBERS, REGROUP, Abort,
                                     Alive, Failure, Mark, Member, Regroup, Report)
from agents.membership import Membership

CFG = JobConfig.of(job="orphaned", name="tiny", stages=2, microbatches=2, iterations=10, elastic=True,
                   failure_timeout=1.0, lease_ttl=5.0)


@contextlib.contextmanager
def _job(etcd, job: str, cfg: JobConfig = CFG, pipelines=((0, 1),)):
    """Epoch 0 over `pipelines`, whose nodes registered no more; agents 7 and 8 in
    standby (they leave at the end)."""
    cfg = cfg.with_(job=job)
    cluster = Cluster(etcd.endpoint, job)
    cluster.put(CONFIG(), cfg)
    cluster.put(ASSIGNMENT(0), Assignment(epoch=0, start=0, pipelines=pipelines))
    standbys = [Membership(Cluster(etcd.endpoint, job), zone, node, cfg) for zone, node in (("a", 7), ("b", 8))]
    try:
        yield cluster, standbys
    finally:
        for m in standbys:
            m.leave()


def _settled(cluster: Cluster, iterations: int) -> None:
    """The boundaries of iterations 0 .. iterations - 1 agreed, as their workers write them."""
    for it in range(iterations):
        cluster.put(REGROUP(it, 0), Regroup((), False, False))


def _reported(cluster: Cluster, it: int, nodes) -> None:
    for node in nodes:
        cluster.put(DONE(it, node), Report(1.0, 0.0, 0))


def test_standby_agents_redo_an_iteration_whose_every_member_is_gone(etcd):
    with _job(etcd, "orphaned") as (cluster, standbys):
        standbys[0].decide(CFG)
        assert sorted(cluster.failed()) == [0, 1]
        redo = cluster.get(ASSIGNMENT(1))
        assert redo is not None and redo.redo and redo.start == 0 and redo.restore == "initial"
        assert sorted(redo.members) == [7, 8]
        standbys[1].decide(CFG)  # the other agent finds it decided
        assert cluster.get(ASSIGNMENT(2)) is None


def test_members_gone_after_reporting_the_iteration_are_redone_too(etcd):
    """Both members reported iteration 3 and died before either wrote its regroup:
    no worker will ever write it, so iteration 3 is redone; so is the job's last
    iteration reported by one member only; reported by all, it is the job
    finishing, and nothing is redone."""
    last = CFG.schedule.iterations - 1
    with _job(etcd, "reported") as (cluster, standbys):
        _settled(cluster, 3)
        _reported(cluster, 3, (0, 1))
        standbys[0].decide(CFG)
        redo = cluster.get(ASSIGNMENT(1))
        assert redo is not None and redo.redo and redo.start == 0 and redo.restore == "initial"
        assert sorted(cluster.failed()) == [0, 1]
    with _job(etcd, "last-partly") as (cluster, standbys):
        _settled(cluster, last)
        _reported(cluster, last, (0,))
        standbys[0].decide(CFG)  # one report of the last iteration: node 1 died before its own
        assert sorted(cluster.failed()) == [0, 1] and cluster.get(ASSIGNMENT(1)).start == 0
    with _job(etcd, "finished") as (cluster, standbys):
        _settled(cluster, last)
        _reported(cluster, last, (0, 1))
        standbys[0].decide(CFG)
        assert cluster.failed() == {} and cluster.get(ASSIGNMENT(1)) is None


def test_chaos_seed_39_two_reports_then_every_member_gone(etcd):
    """bamboo-chaos --trials 50 --seed 1, trial 39 (at 043f0bc): three pipelines,
    node 0 dead in iteration 2 and taken over, nodes 3 and 4 reported iteration 2,
    then bursts took every member before any wrote its regroup; the replacements
    waited out the 600 s limit. The standbys redo iteration 2 (from the start:
    no checkpoint yet, no copy)."""
    cfg = CFG.with_(job="seed-39", stages=3, microbatches=6, iterations=30)
    with _job(etcd, "seed-39", cfg, ((0, 2, 1), (3, 3, 4), (6, 6, 5))) as (cluster, standbys):
        _settled(cluster, 2)
        cluster.record_dead(0, Failure(2, 1, "gloo: Connection closed by peer"))
        _reported(cluster, 2, (3, 4))
        standbys[0].decide(cfg)
        assert sorted(cluster.failed()) == list(range(7))
        redo = cluster.get(ASSIGNMENT(1))
        assert redo is not None and redo.redo and redo.start == 0 and redo.restore == "initial"
        assert sorted(redo.members) == [7, 8]


def test_a_running_worker_or_a_starting_one_keeps_the_epoch(etcd):
    with _job(etcd, "kept") as (cluster, standbys):
        cluster.put(ALIVE(0), Alive(0))  # node 0's worker runs: it reports or aborts itself
        standbys[0].decide(CFG)
        cluster.delete(ALIVE(0))
        cluster.put(MEMBERS(1), Member("b", "h"))  # node 1's agent runs; its worker is still starting
        cluster.put(MEMBERS(0), Member("a", "h"))
        standbys[0].decide(CFG)
        assert cluster.failed() == {} and cluster.get(ASSIGNMENT(1)) is None


def test_members_that_acknowledged_an_abort_and_died_since_hold_no_layers(etcd):
    """Iteration 3 abandoned: nodes 0 and 1 died (recorded), nodes 2 and 3 undid their
    steps, acknowledged, and died unrecorded before the agents decided (chaos
    `--network` seed 29). Their copies of stage 0 are gone with them, so the redo
    restores from the start (no checkpoint), over the standby agents; before, the
    agents counted 2 and 3 as holders, wrote a handover from them that failed at once,
    and lost a minute in its acknowledgement wait."""
    with _job(etcd, "acked-then-gone", pipelines=((0, 1), (2, 3))) as (cluster, standbys):
        _settled(cluster, 3)
        for node in (0, 1):
            cluster.put(FAILED(node), Failure(3, 2, "lease expired"))
        cluster.put(ABORT(3), Abort("a stage lost every copy in its pipeline", 2))
        for node in (2, 3):
            cluster.put(ABORTED(3, node), Mark())
        standbys[0].decide(CFG)  # finds 2 and 3 silent: records them, decides on its next round
        assert sorted(cluster.failed()) == [0, 1, 2, 3]
        standbys[0].decide(CFG)
        redo = cluster.get(ASSIGNMENT(1))
        assert redo is not None and redo.redo and redo.start == 0 and redo.restore == "initial", redo
        assert sorted(redo.members) == [7, 8]
