"""A death from outside at each phase of a real local job: in
the middle of an instruction, several at once across pipelines, during the
barrier agreement, during a process-group rebuild, at a redo decision, during a
checkpoint write, while the agents write the next epoch. (A death while a
standby node is brought in, during the layer handover, is in test_faults.py.)

Each test waits for the etcd key that marks its phase, never for a time, then
SIGKILLs; the job must end with the single-process reference's losses. They run
under `make test-slow` (each is a whole job of five or six nodes)."""
import signal

import pytest

from commands.chaos.chaos import account
from bamboo.control.cluster import Cluster
from bamboo.control.etcd import EtcdServer
from bamboo.control.protocol import ABORT, ASSIGNMENT, CHECKPOINTED, DONE, LOSS, REGROUP, world_store
from tests.integration.test_faults import _finish, _node_processes, _start, _until, reference  # noqa: F401 (a fixture)
from tests.training import redos

pytestmark = pytest.mark.slow
# two pipelines and a standby node, every node kept
AGENTS = ["--local-nodes", "5", "--zones", "a,b,c", "--stages", "2", "--max-stages-per-node", "1", "--surplus", "keep"]


def _kill(proc, nodes, worker_only: bool = False) -> None:
    for node in nodes:
        for p in _node_processes(proc, node):
            if not worker_only or "bamboo.runtime.worker" in p.cmdline():
                p.send_signal(signal.SIGKILL)


def _events(records, kind: str) -> int:
    return sum(e["type"] == kind for r in records for e in r["events"])


def _phase(tmp_path, reference, args, marked, victims, worker_only=False):
    """Start the job, wait until `marked(cluster)` is true, SIGKILL `victims(cluster)`
    (agents with their workers, or the workers alone), and check the result.
    Returns the metrics' records and the nodes recorded dead, which must include
    the victims."""
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        proc = _start(etcd, metrics, *args)
        cluster = Cluster(etcd.endpoint, "faults")
        _until(proc, lambda: marked(cluster), "the phase")
        killed = victims(cluster)
        _kill(proc, killed, worker_only)
        records, failed = _finish(proc, metrics, reference), set(cluster.failed())
    assert set(killed) <= failed
    return records, failed


def _one_per_pipeline(cluster) -> list[int]:
    return [pipe[1] for pipe in cluster.latest_assignment().pipelines]


def test_a_worker_killed_in_the_middle_of_an_instruction(tmp_path, reference):
    """The worker alone (its agent lives on) dies as soon as iteration 4's first loss
    is written: its predecessor takes over within the iteration."""
    _phase(tmp_path, reference, AGENTS, lambda c: c.children(LOSS(4)), lambda c: [1], worker_only=True)


def test_deaths_in_two_pipelines_in_one_iteration(tmp_path, reference):
    """One node of each pipeline, at once, mid-iteration."""
    _phase(tmp_path, reference, AGENTS, lambda c: c.children(LOSS(4)), _one_per_pipeline)


def test_a_death_during_the_barrier_agreement(tmp_path, reference):
    """A node that has not reported iteration 4 yet dies once another has."""
    def not_reported(cluster):
        done, members = cluster.children(DONE(4)), cluster.latest_assignment().members
        return [next((n for n in members if n not in done), members[-1])]  # all reported: still the boundary
    _phase(tmp_path, reference, AGENTS, lambda c: c.children(DONE(4)), not_reported)


def test_a_death_during_a_process_group_rebuild(tmp_path, reference):
    """Without agents: node 1 dies in iteration 4, so the boundary rebuilds the world
    group without it; node 3 (the other pipeline) dies as that group forms, and the
    next try leaves it out too."""
    def forming(cluster):  # iteration 4's first try, in epoch 0 (there are no agents)
        return list(cluster.client.get_prefix(cluster.key(world_store(0, 4, 0))))
    _, failed = _phase(tmp_path, reference, ["--stages", "2", "--pipelines", "2", "--preempt", "1@4:3"],
                       forming, lambda c: [3])
    assert failed == {1, 3}


def test_a_death_at_the_redo_decision(tmp_path, reference):
    """Two neighbours of one pipeline die mid-iteration: it cannot finish, so the
    iteration is abandoned everywhere (ABORT) and redone; a node of the other
    pipeline dies as soon as that is posted, while the agents decide the redo."""
    def neighbours(cluster):
        return list(cluster.latest_assignment().pipelines[0][:2])
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        proc = _start(etcd, metrics, "--local-nodes", "7", "--zones", "a,b,c", "--stages", "3", "--surplus", "keep",
                      "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
        cluster = Cluster(etcd.endpoint, "faults")
        _until(proc, lambda: cluster.children(LOSS(4)), "iteration 4's first loss")
        other = cluster.latest_assignment().pipelines[1][0]
        _kill(proc, neighbours(cluster))
        _until(proc, lambda: cluster.children(ABORT()), "the abort")
        _kill(proc, [other])
        records = _finish(proc, metrics, reference)
    assert _events(records, "redo") >= 1


def test_a_death_during_a_checkpoint_write(tmp_path, reference):
    """A pipeline-0 node (the checkpoint's writers) dies as soon as a checkpoint is
    decided, while it writes in the background."""
    args = [*AGENTS, "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    _phase(tmp_path, reference, args, lambda c: c.get(CHECKPOINTED()),
           lambda c: [c.latest_assignment().pipelines[0][0]])


def test_a_death_while_the_agents_write_the_next_epoch(tmp_path, reference):
    """Node 2 dies in iteration 4; the boundary decides that the agents reconfigure,
    and another node dies before they have written the next epoch."""
    def deciding(cluster):
        agreed = cluster.children(REGROUP(4))
        return any(r.reconfigure for r in agreed.values()) and 1 not in cluster.children(ASSIGNMENT())
    _, failed = _phase(tmp_path, reference, [*AGENTS, "--preempt", "2@4:3"], deciding, lambda c: [0])
    assert {0, 2} <= failed


def test_a_stage_lost_everywhere_before_any_checkpoint_goes_back_to_the_start(tmp_path, reference):
    """One pipeline of three and two standby nodes, no checkpoint: two neighbours
    die at once, so the stage between them has no copy anywhere. Every layer's
    first values come from the seed alone, so the job goes back to iteration 0
    (restore "initial") on the three nodes left, and repeats no applied sample."""
    def neighbours(cluster):
        return list(cluster.latest_assignment().pipelines[0][:2])
    records, _ = _phase(tmp_path, reference, ["--local-nodes", "5", "--zones", "a,b,c", "--stages", "3",
                                                  "--max-stages-per-node", "1", "--surplus", "keep"],
                        lambda c: c.children(LOSS(3)), neighbours)
    redo = redos(records)
    assert redo and redo[-1]["restore"] == "initial" and redo[-1]["from"] == 0
    assert account(records, len(reference), 12) == (0, 0)
