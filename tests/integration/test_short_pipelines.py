"""Pipelines shorter than P, on the runtime's side: five local nodes at
P=3 train as a pipeline of three nodes and one of two, in which one node runs two
stages; the global microbatches are split by speed (5 and 3 of 8). Real agents,
real workers, a real etcd, real SIGKILLs (--preempt), compared with the
single-process reference in float64: the losses and the final parameters are the
reference's through a death in the short pipeline (its iteration is redone from
the full pipeline's copies) and one in the full pipeline (its predecessor takes
over, and at the boundary the full pipeline is mended with a node of the short one).
"""

import pytest

from bamboo.control.assignment import Assignment
from tests.integration.test_agents import assert_same_training, reconfigurations
from tests.training import bamboo_train, redos, train_refusal

ITERS = 5
M = 8
COMMON = ["--model", "tiny", "--stages", "3", "--microbatches", str(M), "--iterations", str(ITERS), "--seed", "5",
          "--dtype", "float64", "--check-replicas"]
FIVE = ["--local-nodes", "5", "--zones", "a,b,c", "--surplus", "keep"]  # kept nodes train even where they earn less
_reference: list = []


@pytest.fixture
def reference(tmp_path_factory):
    if not _reference:
        tmp = tmp_path_factory.mktemp("reference")
        _, records = bamboo_train(tmp / "m.jsonl", *COMMON, "--stages", "1", "--save-dir", str(tmp / "params"))
        _reference.append((records, tmp / "params"))
    return _reference[0]


def train(tmp_path, *args):
    _, records = bamboo_train(tmp_path / "m.jsonl", *COMMON, *FIVE, "--save-dir", str(tmp_path / "params"), *args,
                              timeout=300)
    return records


def assert_same(records, tmp_path, reference):
    """assert_same_training of tests/integration/test_agents.py, over this file's iterations."""
    import tests.integration.test_agents as agents
    iters, agents.ITERS = agents.ITERS, ITERS
    try:
        assert_same_training(records, tmp_path, reference)
    finally:
        agents.ITERS = iters


def final(records):
    """The last record of each iteration (a redone iteration appears twice)."""
    return list({r["iteration"]: r for r in records}.values())


def test_an_assignment_with_a_short_pipeline():
    """P=3 over 5 nodes: node 3 runs stages 0 and 1 of pipeline 1. Its stage 1 is a
    local id failed from the start; it holds its two stages and no replica, while
    node 4 keeps the replica of stage 0 as a one-stage node does."""
    a = Assignment(0, 0, ((0, 2, 1), (3, 3, 4)))
    assert a.members == (0, 1, 2, 3, 4) and a.slot(3) == (1, 0) and a.slot(4) == (1, 2)
    assert a.local_failed(1, ()) == (1,) and a.local_failed(1, (4,)) == (1, 2) and a.local_failed(0, (2,)) == (1,)
    assert [len(a.microbatches(M, j)) for j in range(2)] == [5, 3]
    assert list(a.microbatches(M, 0)) + list(a.microbatches(M, 1)) == list(range(M))
    assert a.holders(()) == {0: {0, 1}, 2: {1, 2}, 1: {2, 0}, 3: {0, 1}, 4: {2, 0}}
    assert a.holders((), "off") == {0: {0}, 2: {1}, 1: {2}, 3: {0, 1}, 4: {2}}
    assert a.lost(1, (3,)) == {1} and a.lost(1, (4,)) == {2} and a.lost(0, (2,)) == set()
    assert a.lost(1, (3,), "off") == {0, 1}
    even = Assignment(0, 0, ((0, 1), (2, 3)))
    assert [list(even.microbatches(5, j)) for j in range(2)] == [[0, 1, 2], [3, 4]]  # as split_microbatches
    assert [list(a.microbatches(1, j)) for j in range(2)] == [[0], []]  # fewer batches than pipelines
    one = Assignment(0, 0, ((0, 1), (2, 2)))  # P=2: a pipeline of one node runs the whole model
    assert one.stages_of(2) == (0, 1) and one.local_failed(1, ()) == (1,)


@pytest.mark.parametrize("args, named", [
    (["--max-stages-per-node", "0"], "must be 1 or 2 (got 0)"),
    (["--max-stages-per-node", "3"], "merges"),
    (["--stages", "5", "--local-nodes", "2"], "5 stages cannot fit on 2 nodes at --max-stages-per-node 2"),
    (["--stages", "3", "--local-nodes", "2", "--max-stages-per-node", "1"], "3 stages cannot fit on 2 nodes"),
])
def test_a_split_that_cannot_be_run_is_refused(tmp_path, args, named, capsys):
    status, err = train_refusal(capsys, "--no-progress", "--metrics-out", str(tmp_path / "m.jsonl"), *args)
    assert status == 2 and err.strip().count("\n") == 0 and named in err, err
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_a_death_in_the_short_pipeline_is_redone_from_the_full_one(tmp_path, reference):
    """Node 3 runs stages 0 and 1 of the short pipeline and is SIGKILLed in
    iteration 2: no node of its pipeline holds stage 1, so iteration 2 is abandoned
    and redone, the full pipeline's copies supplying the layers. The four nodes
    left form two pipelines of two."""
    records = train(tmp_path, "--preempt", "3@2:9")
    (it0, first), (it1, second) = reconfigurations(records)
    assert it0 == 0 and first["pipelines"] == [[0, 2, 1], [3, 3, 4]] and first["microbatches"] == [5, 3]
    assert [r["nodes"] for r in records[:2]] == [5, 5]
    redo = redos(records)
    assert redo == [{"type": "redo", "abandoned": 2, "from": 2, "restore": "peers"}]
    why = [e["why"] for r in records for e in r["events"] if e["type"] == "redo"]
    assert "stage 1 has no copy left in this pipeline" in why[0], why  # the reason of the node that gave up
    assert it1 == 2 and 3 not in sum(second["pipelines"], []) and second["standby"] == []
    assert [len(set(p)) for p in second["pipelines"]] == [2, 2] and second["microbatches"] == [4, 4]
    assert_same(final(records), tmp_path, reference)


def test_a_death_in_the_full_pipeline_takes_a_node_of_the_short_one(tmp_path, reference):
    """Node 2 (stage 1 of the full pipeline) is SIGKILLed in iteration 2: its
    predecessor takes the stage over inside the iteration (a failover, no redo);
    at the boundary the full pipeline is mended with a node of the short pipeline,
    whose other node waits in standby (one node cannot hold three stages)."""
    records = train(tmp_path, "--preempt", "2@2:4")
    (it0, first), (it1, second) = reconfigurations(records)
    assert first["pipelines"] == [[0, 2, 1], [3, 3, 4]] and first["microbatches"] == [5, 3]
    assert [e["type"] for e in records[2]["events"]].count("failover") == 1
    assert not redos(records)
    assert it1 == 3 and len(second["pipelines"]) == 1 and second["microbatches"] == [M]
    mended = second["pipelines"][0]
    assert mended[0] == 0 and mended[2] == 1 and mended[1] in (3, 4) and second["standby"] == [7 - mended[1]]
    assert records[3]["nodes"] == 3
    assert_same(records, tmp_path, reference)
