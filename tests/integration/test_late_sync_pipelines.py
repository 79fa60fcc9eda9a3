"""`--replica-sync next` with two pipelines (piece 4 of docs/HOTPATH.md's plan), end
to end: real agents, workers, etcd and SIGKILLs, each run compared with the
single-process reference on the same samples (float64, a cosine schedule with
warm-up: every iteration its own rate).

With D > 1 an owner's death is not survivable inside the iteration in two windows:
before its sync of the iteration before has landed (its holder's replica is a step
behind), and after its data-parallel reduce (its pipeline's share went into the
peers' sums). The agents then redo the iteration, taking the stage from a peer
pipeline's owner. Anywhere else its predecessor takes it over in the iteration and
joins the stage's reduce in its place."""
import pytest

from schedules.compiler import compile_schedule
from schedules.ir import INPUT_GRADS, Op

from tests.training import bamboo_train
from schedules.options import ScheduleOptions

P, M, ITERS = 2, 4, 8
COMMON = ["--model", "tiny", "--stages", str(P), "--microbatches", str(M), "--iterations", str(ITERS),
          "--seed", "7", "--dtype", "float64", "--lr-schedule", "cosine", "--warmup", "3", "--replica-sync", "next"]
AGENTS = ["--local-nodes", "5", "--zones", "a,b", "--max-stages-per-node", "1",
          "--surplus", "keep"]  # two pipelines and a spare, kept
RTOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, records = bamboo_train(tmp_path_factory.mktemp("late-pipelines") / "m.jsonl", *COMMON, "--stages", "1")
    return records


def stream(stage: int):
    """A stage's stream with two pipelines: each runs M / 2 microbatches."""
    return compile_schedule(P, M // 2, (), options=ScheduleOptions(redundancy="eager", sync="next")).streams[stage]


def after_reduce(stage: int) -> int:
    s = stream(stage)
    return next(i for i, x in enumerate(s) if x.op is Op.REDUCE_GRADS) + 1


def first_backward(stage: int) -> int:
    """An instruction after the stage's late sync (its stream's first) has landed."""
    s = stream(stage)
    assert s[0].op is Op.SEND_SYNC
    return next(i for i, x in enumerate(s) if x.op in INPUT_GRADS)


def assert_same_losses(records, reference):
    records = list({r["iteration"]: r for r in records}.values())  # a redone iteration as it last ran
    assert [r["iteration"] for r in records] == list(range(ITERS))
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), f"iteration {got['iteration']}"


def events(records, kind):
    return [(r["iteration"], {k: v for k, v in e.items() if k != "type"}) for r in records for e in r["events"]
            if e["type"] == kind]


@pytest.mark.slow
def test_deaths_after_a_reduce_or_before_a_sync_landed_are_redone_from_a_peer_pipeline(tmp_path, reference):
    """Pipelines (0, 1) and (2, 3), node 4 spare. Node 2 dies in iteration 2 after
    its reduce of stage 0 and before its step: node 3 (its holder) recomputes stage
    0, finds the sum taken without it, and the iteration is redone with node 4 on
    stage 0, copied from node 0. Node 4 then dies in iteration 4 before its sync of
    iteration 3 left: node 3's replica is a step behind, and iteration 4 is redone
    from node 0's copy again. No checkpoint is read; the losses are the reference's.
    (Node 3 had finished its stream when node 2 died: a boundary that took its
    finished mark for its report went on without the redo.)"""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *AGENTS, "--checkpoint", str(tmp_path / "ckpt"),
                              "--preempt", f"2@2:{after_reduce(0)}", "--preempt", "4@4:0")
    assert events(records, "reconfigure")[0][1]["pipelines"] == [[0, 1], [2, 3]]
    assert events(records, "redo") == [(2, {"abandoned": 2, "from": 2, "restore": "peers"}),
                                       (4, {"abandoned": 4, "from": 4, "restore": "peers"})]
    assert events(records, "reconfigure")[1] == (2, {"epoch": 1, "pipelines": [[0, 1], [4, 3]], "standby": [],
                                                     "redundancy": "eager", "microbatches": [2, 2],
                                                     "sync": "next"})
    assert not events(records, "failover")
    assert_same_losses(records, reference)


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes
def test_a_death_after_its_sync_landed_is_taken_over_beside_a_peer_pipeline(tmp_path, reference):
    """Node 0 dies in iteration 2 after its sync landed: node 1 takes stage 0 over
    and reduces it with node 2. Node 4 joins pipeline 0 at the boundary with every
    replica sent by its owner; node 1 then dies in iteration 5 before its sync
    left, which is redone from node 3's copy of stage 1."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *AGENTS, "--checkpoint", str(tmp_path / "ckpt"),
                              "--preempt", f"0@2:{first_backward(0)}", "--preempt", "1@5:0")
    assert [(it, e["node"], e["by"]) for it, e in events(records, "failover")] == [(2, 0, 1)]
    assert events(records, "redo") == [(5, {"abandoned": 5, "from": 5, "restore": "peers"})]
    assert_same_losses(records, reference)


@pytest.mark.slow  # make test-slow: two pipelines with the late sync run in make test with agents (above)
def test_without_agents_two_pipelines_survive_a_death_after_its_sync_landed(tmp_path, reference):
    """--pipelines 2 without agents: node 1 dies in iteration 2 after its sync
    landed; node 0 runs both stages of pipeline 0 from then on, its stage 1 reduced
    with node 3's, and the losses are the reference's."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2",
                              "--preempt", f"1@2:{first_backward(1)}")
    assert [(it, e["node"], e["by"]) for it, e in events(records, "failover")] == [(2, 1, 0)]
    assert_same_losses(records, reference)


@pytest.mark.slow
def test_without_agents_a_death_before_its_sync_landed_ends_the_job_by_name(tmp_path):
    """Without agents nobody can redo the iteration: node 3 dying before its sync
    left ends the job with the reason, in one line."""
    out, _ = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2", "--preempt", "3@2:0", check=False)
    assert out.returncode == 1
    assert "had not arrived: that replica of its stage is then a step behind (--replica-sync next)" in out.stderr
