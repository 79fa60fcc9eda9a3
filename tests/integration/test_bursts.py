"""Several deaths at once on real processes: real agents, workers, etcd and SIGKILLs,
each run compared with the single-process reference on the same samples (float64).

Nine nodes at P=4 in three zones: one full pipeline (nodes 0, 1, 3, 2 on stages 0-3)
and two short ones. Nodes 1 and 2 (stages 1 and 3 of the full pipeline) die at the
same instruction of iteration 8. Their stages are not neighbours, so each still has a
copy in the pipeline; but the compiler plans a recovery from one death per pipeline
per iteration, so the iteration is abandoned job-wide and redone from the survivors'
copies, whichever of the two deaths the survivors see first (before, a death seen
after the pipeline had recovered from the other was planned on the wrong streams,
and the job failed with 'node ran past its recovery point')."""
import pytest

from schedules.compiler import compile_schedule

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import Failure, Local
from bamboo.runtime.failover import Failover
from bamboo.runtime.watch import PeerDead, TooManyDead, Watch

from tests.training import bamboo_train, redos
from schedules.options import ScheduleOptions
from bamboo.control.config import JobConfig

ITERS, KILLED_IN = 9, 8
COMMON = ["--model", "tiny", "--microbatches", "8", "--seed", "11", "--stages", "4", "--dtype", "float64",
          "--iterations", str(ITERS)]
# Eighteen processes on the machine: a loaded one must not find a slow node dead (a
# SIGKILL is seen at once whatever the timeout) nor judge it a straggler
AGENTS = ["--local-nodes", "9", "--zones", "a,b,c", "--failure-timeout", "10", "--straggler-factor", "0",
          "--surplus", "keep"]  # every node kept: the full pipeline and two short ones
FULL = [0, 1, 3, 2]  # the full pipeline the policy lays out for these nine nodes
RTOL = 1e-9


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, records = bamboo_train(tmp_path_factory.mktemp("bursts") / "m.jsonl", *COMMON, "--stages", "1")
    return records


def stream_length(mode: str, local: int) -> int:
    """Instructions of a node of the full pipeline in iteration 8 (4 of the 8
    microbatches: the short pipelines run 2 each), as the kill positions count them."""
    return len(compile_schedule(4, 4, (), options=ScheduleOptions(redundancy=mode)).streams[local])


def two_deaths(tmp_path, reference, mode: str, k1: int, k2: int):
    """Kill nodes 1 and 2 before their instructions k1 and k2 of iteration 8; the run
    must be the reference's, with iteration 8 redone from the survivors."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *AGENTS, "--redundancy", mode,
                              "--preempt", f"1@{KILLED_IN}:{k1}", "--preempt", f"2@{KILLED_IN}:{k2}")
    first = [e for e in records[0]["events"] if e["type"] == "reconfigure"][0]
    assert first["pipelines"][0] == FULL and first["microbatches"] == [4, 2, 2]
    redone = redos(records)
    assert {"type": "redo", "abandoned": KILLED_IN, "from": KILLED_IN, "restore": "peers"} in redone, redone
    assert all(e["restore"] == "peers" for e in redone), redone  # nothing went back to a checkpoint
    last = list({r["iteration"]: r for r in records}.values())  # a redone iteration as it last ran
    assert [r["iteration"] for r in last] == list(range(ITERS))
    for got, want in zip(last, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"iteration {got['iteration']}"


@pytest.mark.slow
def test_two_deaths_in_the_full_pipeline_beside_short_ones_are_redone_from_the_survivors(tmp_path, reference):
    two_deaths(tmp_path, reference, "eager", 3, 3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lazy", "off"])
def test_the_same_two_deaths_in_the_other_modes(tmp_path, reference, mode):
    two_deaths(tmp_path, reference, mode, 3, 3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "lazy", "off"])
@pytest.mark.parametrize("k", range(40))
def test_the_two_deaths_at_every_instruction_of_the_iteration(tmp_path, reference, mode, k):
    """Both at instruction k of their streams (k past a stream's end: after it, at its boundary)."""
    longest = max(stream_length(mode, FULL.index(1)), stream_length(mode, FULL.index(2)))
    if k > longest:
        pytest.skip(f"{mode}: the streams have {longest} instructions")
    two_deaths(tmp_path, reference, mode, min(k, stream_length(mode, FULL.index(1))),
               min(k, stream_length(mode, FULL.index(2))))


def test_a_death_seen_after_the_pipeline_recovered_from_another_abandons_the_iteration(etcd):
    """On a real etcd: node 1 recorded dead, then, once the pipeline replanned without
    it, node 2. The second look must not plan a recovery on the first one's streams."""
    cluster = Cluster(etcd.endpoint, "second-death")
    failover = Failover(cluster, tuple(FULL), 0, 0, ScheduleOptions(redundancy="eager"), JobConfig.of(elastic=True))
    failover.now = Watch(iteration=KILLED_IN, microbatches=4, failed=(), comm=None, streams={})
    cluster.record_dead(1, Failure(KILLED_IN, 0, "test"))
    assert failover.poll() == PeerDead(Local(1))
    # what resolve() leaves once the recovery stream is running
    failover.now.failed, failover.now.recovered = (Local(1),), True
    failover.now.dead, failover.now.event, failover.now.due = None, None, True
    assert failover.poll() is None
    cluster.record_dead(2, Failure(KILLED_IN, 3, "test"))
    failover.now.due = True
    event = failover.poll()
    assert isinstance(event, TooManyDead) and "after the pipeline recovered" in event.why


@pytest.mark.slow
def test_a_pipeline_lost_whole_after_its_reduce_still_counts_its_losses(tmp_path):
    """Both nodes of one of two pipelines die after their streams, past the reduce that
    put their gradients in every sum but before the finished marks: the step is whole,
    and the losses must have been stored before the reduce (before, the launcher found
    2 of 4 and ended the job; chaos `--network` seed 26 met it as a partition)."""
    common = ["--model", "tiny", "--microbatches", "4", "--seed", "11", "--stages", "2", "--dtype", "float64",
              "--iterations", "6"]
    _, reference = bamboo_train(tmp_path / "ref.jsonl", *common, "--stages", "1")
    streams = compile_schedule(2, 2, (), options=ScheduleOptions(redundancy="eager")).streams
    lengths = [len(streams[0]), len(streams[1])]  # stage 0 (node 1) and stage 1 (node 3)
    _, records = bamboo_train(tmp_path / "m.jsonl", *common, "--local-nodes", "4", "--straggler-factor", "0",
                              "--preempt", f"1@3:{lengths[0]}", "--preempt", f"3@3:{lengths[1]}")
    first = [e for e in records[0]["events"] if e["type"] == "reconfigure"][0]
    assert first["pipelines"] == [[0, 2], [1, 3]]  # nodes 1 and 3 are the whole second pipeline
    assert [e["type"] for e in records[3]["events"]].count("preemption") == 2
    assert not redos(records)  # iteration 3 was complete
    assert [r["iteration"] for r in records] == list(range(6))
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"iteration {got['iteration']}"
