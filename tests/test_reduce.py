"""The data-parallel reduce's group (bamboo/runtime/reduce.py) against a real etcd: a
member that abandoned the iteration never comes to the rendezvous, and the
waiting node must notice the abort rather than wait out --hang-timeout."""
import os
import subprocess
import sys
import threading

import torch

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import ABORT, ALIVE, Abort, Alive
from bamboo.runtime.failover import Aborted, Failover, Watch
from bamboo.runtime.reduce import Reducer

HANG_TIMEOUT = 600.0  # far longer than the test waits: only the abort can end the wait


def scenario(endpoint: str) -> None:
    """Run in a child process (below), which leaves with os._exit: the given-up
    rendezvous stays blocked inside gloo's constructor until its own timeout, and
    a normal interpreter exit would abort on that thread."""
    cluster = Cluster(endpoint, "reduce-abort")
    cluster.put(ALIVE(0), Alive(0))
    cluster.put(ALIVE(2), Alive(2))  # node 2 is alive (its key is there) but went to the redo
    assignment = Assignment.static(stages=2, pipelines=2)  # stage 0 on node 0 and on node 2
    failover = Failover(cluster, (0, 1), 0, 0, "off", 3.0, elastic=True)
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
    child = subprocess.run([sys.executable, "-c", f"import tests.test_reduce as t; t.scenario({etcd.endpoint!r})"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    said = child.stdout.strip()
    assert said != "waiting", "the reduce still waits for a member that aborted the iteration"
    assert said.startswith("Aborted: ") and " | " not in said, said
    assert "redundancy off" in said
