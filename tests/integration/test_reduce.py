"""The data-parallel reduce's group (bamboo/runtime/reduce.py) against a real etcd: a
member that abandoned the iteration never comes to the rendezvous, and the
waiting node must notice the abort rather than wait out --hang-timeout."""
import json
import os
import subprocess
import sys
import threading
import uuid

import torch

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import ABORT, ALIVE, FAILED, LEASE_EXPIRED, Abort, Alive, Failure, Local
from bamboo.runtime.failover import Aborted, Failover
from bamboo.runtime.watch import Watch
from bamboo.runtime.reduce import Reducer
from bamboo.transport.comm import Interrupted
from bamboo.control.config import JobConfig
from schedules.options import ScheduleOptions

HANG_TIMEOUT = 600.0  # far longer than the test waits: only the abort can end the wait


def scenario(endpoint: str) -> None:
    """Run in a child process (below), which leaves with os._exit: the given-up
    rendezvous stays blocked inside gloo's constructor until its own timeout, and
    a normal interpreter exit would abort on that thread."""
    cluster = Cluster(endpoint, "reduce-abort")
    cluster.put(ALIVE(0), Alive(0))
    cluster.put(ALIVE(2), Alive(2))  # node 2 is alive (its key is there) but went to the redo
    assignment = Assignment.static(stages=2, pipelines=2)  # stage 0 on node 0 and on node 2
    failover = Failover(cluster, (0, 1), 0, 0, ScheduleOptions(redundancy="off"), JobConfig.of(elastic=True))
    failover.now = Watch(iteration=2, microbatches=0, failed=(), comm=None, streams={})
    reducer = Reducer(cluster, assignment, 0, 3.0, failover, HANG_TIMEOUT)
    assert reducer.members(0) == (0, 2)
    cluster.create(ABORT(2), Abort("node 3 died with redundancy off", 2))

    module = torch.nn.Linear(2, 2)
    module(torch.ones(1, 2)).sum().backward()
    raised = []

    def reduce():
        try:
            reducer.allreduce(2, 0, module)
        except BaseException as e:  # noqa: BLE001 - reported below
            raised.append(e)
    t = threading.Thread(target=reduce, daemon=True)
    t.start()
    t.join(timeout=60)
    print("waiting" if t.is_alive() else " | ".join(f"{type(e).__name__}: {e}" for e in raised), flush=True)
    os._exit(0)


def test_a_reduce_rendezvous_with_a_peer_that_aborted_gives_up_on_the_abort(etcd):
    child = subprocess.run([sys.executable, "-c", f"import tests.integration.test_reduce as t; t.scenario({etcd.endpoint!r})"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    said = child.stdout.strip()
    assert said != "waiting", "the reduce still waits for a member that aborted the iteration"
    assert said.startswith("Aborted: ") and " | " not in said, said
    assert "redundancy off" in said


def called_away(endpoint: str, job: str, node: int) -> None:
    """Node 0 or node 2 (stage 0 of pipelines 0 and 1) of a reduce test, in a child
    process; prints the sums it got. Node 0 starts iteration 2's reduce alone and is
    called away by its pipeline mate's death (it would owe the pipeline its report);
    node 2 comes only once node 0 said so, and node 0 then takes its pending reduce up."""
    cluster = Cluster(endpoint, job)
    failover = Failover(cluster, (node, node + 1), node // 2, 0, ScheduleOptions(redundancy="eager"),
                        JobConfig.of(elastic=True))
    reducer = Reducer(cluster, Assignment.static(stages=2, pipelines=2), node, 3.0, failover, HANG_TIMEOUT)
    module = torch.nn.Linear(2, 1, bias=False)
    sums = []
    for it in (1, 2):
        failover.now = Watch(iteration=it, microbatches=0, failed=(), comm=None, streams={})
        module.weight.grad = torch.full((1, 2), float(10 * it + node))
        if it == 2 and node == 2:
            cluster.wait_for(lambda: cluster.client.get(cluster.key("test/called-away"))[0], timeout=60, what="node 0")
        if it == 2 and node == 0:
            cluster.put(FAILED(1), Failure(2, 0, LEASE_EXPIRED))
            try:
                reducer.allreduce(it, 0, module)
                sums.append("not called away")
            except Interrupted:
                cluster.client.put(cluster.key("test/called-away"), "yes")
            failover.now.failed, failover.now.event = (Local(1),), None  # what the replan settles
        reducer.allreduce(it, 0, module)
        sums.append(module.weight.grad.flatten().tolist())
    print(json.dumps(sums), flush=True)
    os._exit(0)


def test_a_reduce_is_called_away_by_a_death_in_its_pipeline_and_taken_up_after(etcd):
    """Without this, a node waiting in its stage's reduce could not report on a
    dead pipeline mate, and the mate's successor (whose own reduce the group may
    wait behind) waited for that report: chaos seed 20 stalled 30 s on this cycle."""
    job = f"reduce-called-away-{uuid.uuid4().hex[:8]}"  # the etcd is the module's
    cluster = Cluster(etcd.endpoint, job)
    for n in (0, 2):  # both alive before either looks (a child slow to start is not silent)
        cluster.put(ALIVE(n), Alive(n))
    children = [subprocess.Popen([sys.executable, "-c",
                                  f"import tests.integration.test_reduce as t; t.called_away({etcd.endpoint!r}, {job!r}, {n})"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 2)]
    try:
        outs = [c.communicate(timeout=120) for c in children]
    finally:
        for c in children:
            c.kill()
    for c, (out, err) in zip(children, outs):
        assert c.returncode == 0 and out.strip(), err[-2000:]
    want = [[10.0 + 12.0] * 2, [20.0 + 22.0] * 2]  # each iteration's two gradients summed, once
    assert [json.loads(out) for out, _ in outs] == [want, want]
