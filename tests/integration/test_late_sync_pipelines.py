"""`--replica-sync next` with two pipelines (piece 4 of docs/HOTPATH.md's plan), end
to end: real agents, workers, etcd and SIGKILLs, each run compared with the
single-process reference on the same samples (float64, a cosine schedule with
warm-up: every iteration its own rate).

An owner's death has two windows: before its sync of the iteration before has
landed (its holder's replica is a step behind), and after its data-parallel reduce
(its pipeline's share went into the peers' sums). With D > 1 the holder borrows
what is missing from the other pipeline's owner of the stage (its kept gradients,
or the reduced sum: bamboo/runtime/lending.py) and takes the stage over inside the
iteration; the failover event names the lender. Anywhere else its predecessor takes
it over and joins the stage's reduce in its place."""
import re

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


def failovers(records):
    """(iteration, dead, taker, lender, what was lent) of every failover."""
    return [(it, e["node"], e["by"], e["lent_by"], e["lent"]) for it, e in events(records, "failover")]


@pytest.mark.slow
def test_deaths_after_a_reduce_or_before_a_sync_landed_borrow_from_the_other_pipeline(tmp_path, reference):
    """Pipelines (0, 1) and (2, 3), node 4 spare. Node 2 dies in iteration 2 after
    its reduce of stage 0 and before its step: node 3 (its holder) takes stage 0
    over with the sum node 0 lends. Node 4 joins on stage 0 at the boundary; it
    dies in iteration 4 before its sync of iteration 3 left: node 3 steps its
    replica with the gradients node 0 kept for its own holder, and takes over
    again. Nothing is redone (epoch 1 starts after iteration 2), no checkpoint is
    read, the losses are the reference's."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *AGENTS, "--checkpoint", str(tmp_path / "ckpt"),
                              "--preempt", f"2@2:{after_reduce(0)}", "--preempt", "4@4:0")
    assert events(records, "reconfigure")[0][1]["pipelines"] == [[0, 1], [2, 3]]
    assert failovers(records) == [(2, 2, 3, 0, "reduced"), (4, 4, 3, 0, "kept")]
    assert not events(records, "redo") and not events(records, "rollback")
    assert events(records, "reconfigure")[1] == (3, {"epoch": 1, "pipelines": [[0, 1], [4, 3]], "standby": [],
                                                     "redundancy": "eager", "microbatches": [2, 2],
                                                     "sync": "next"})
    assert_same_losses(records, reference)


@pytest.mark.slow  # make test-slow: keeps make test under 15 minutes
def test_a_death_after_its_sync_landed_is_taken_over_beside_a_peer_pipeline(tmp_path, reference):
    """Node 0 dies in iteration 2 after its sync landed: node 1 takes stage 0 over
    and reduces it with node 2, nothing lent. Node 4 joins pipeline 0 at the
    boundary with every replica sent by its owner; node 1 then dies in iteration 5
    before its sync left: node 4 borrows node 3's kept gradients of stage 1."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *AGENTS, "--checkpoint", str(tmp_path / "ckpt"),
                              "--preempt", f"0@2:{first_backward(0)}", "--preempt", "1@5:0")
    assert failovers(records) == [(2, 0, 1, None, ""), (5, 1, 4, 3, "kept")]
    assert not events(records, "redo")
    assert_same_losses(records, reference)


@pytest.mark.slow  # make test-slow: two pipelines with the late sync run in make test (below)
def test_without_agents_two_pipelines_survive_a_death_after_its_sync_landed(tmp_path, reference):
    """--pipelines 2 without agents: node 1 dies in iteration 2 after its sync
    landed; node 0 runs both stages of pipeline 0 from then on, its stage 1 reduced
    with node 3's, and the losses are the reference's."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2",
                              "--preempt", f"1@2:{first_backward(1)}")
    assert [(it, e["node"], e["by"]) for it, e in events(records, "failover")] == [(2, 1, 0)]
    assert_same_losses(records, reference)


def test_without_agents_deaths_in_both_windows_borrow_and_go_on(tmp_path, reference):
    """Without agents nothing could redo an iteration. Node 3 dies in iteration 2
    before its sync left: node 2 borrows node 1's kept gradients of stage 1 and
    runs pipeline 1 alone. Node 1 dies in iteration 5 after its reduce of stage 1:
    node 0 borrows the sum from node 2, which took that stage over. The job ends,
    and its losses are the reference's."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2", "--preempt", "3@2:0",
                              "--preempt", f"1@5:{after_reduce(1)}")
    assert failovers(records) == [(2, 3, 2, 1, "kept"), (5, 1, 0, 2, "reduced")]
    assert_same_losses(records, reference)


@pytest.mark.slow
def test_without_agents_each_pipeline_borrows_from_the_other_at_once(tmp_path, reference):
    """A burst in iteration 2, before either sync left: node 0 (stage 0 of pipeline
    0) and node 3 (stage 1 of pipeline 1). Node 1 borrows stage 0's kept gradients
    from node 2 while node 2 borrows stage 1's from node 1: each serves while it
    waits for its own loan. Both pipelines then run merged, and the losses are the
    reference's."""
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2", "--preempt", "0@2:0",
                              "--preempt", "3@2:0")
    assert sorted(failovers(records)) == [(2, 0, 1, 2, "kept"), (2, 3, 2, 1, "kept")]
    assert_same_losses(records, reference)


@pytest.mark.slow  # make test-slow: a loan in both windows runs in make test (above)
def test_without_agents_stage_0_runs_ahead_past_its_late_sync_and_a_loan_keeps_the_math(tmp_path, reference):
    """--compute-ahead with the sync in the next iteration: stage 0's stream begins
    with its late sync, and the forward after it runs while the boundary agrees
    (bamboo/runtime/ahead.py). Node 3 dies in iteration 2 before its sync left:
    node 2 borrows node 1's kept gradients. The losses are the reference's."""
    logs = tmp_path / "logs"
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, "--pipelines", "2", "--compute-ahead",
                              "--log-dir", str(logs), "--preempt", "3@2:0")
    assert failovers(records) == [(2, 3, 2, 1, "kept")]
    said = [line for f in sorted(logs.iterdir()) for line in f.read_text().splitlines() if "run while the" in line]
    began = [int(re.search(r"(\d+) iterations began", line)[1]) for line in said]
    assert began and min(began) >= ITERS // 2, said  # node 0 (and node 2, stage 0 of merged pipeline 1)
    assert_same_losses(records, reference)
