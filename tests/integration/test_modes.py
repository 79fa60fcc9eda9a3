"""Redundancy modes with agents: `off` survives a death by redoing the iteration
from a peer pipeline's copy of the lost stage (no replica anywhere), `lazy` by
FRC and BRC after the death, `auto` switches between modes live; all keep the
single-process reference's losses. And the settings where a mode cannot survive
a death are refused up front."""

import pytest

from tests.training import bamboo_train, redos, train_refusal

COMMON = ["--model", "tiny", "--microbatches", "4", "--iterations", "8", "--dtype", "float64"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return bamboo_train(tmp_path_factory.mktemp("ref") / "ref.jsonl", *COMMON, "--stages", "1")[1]


def losses(records):
    return [r["loss"] for r in records]


def events(records, it):
    return {e["type"] for e in records[it]["events"]}


@pytest.mark.slow  # make test-slow (with the other runs of this file: make test keeps the refusals below)
def test_off_with_agents_redoes_the_iteration_from_a_peer_pipeline(tmp_path, reference):
    """Two pipelines of 2 and a standby, no replicas: node 1 dies in iteration 2;
    the iteration is abandoned everywhere, redone with the standby holding stage 1
    (copied from pipeline 1's owner), and no sample is lost or counted twice."""
    _, got = bamboo_train(tmp_path / "off.jsonl", *COMMON, "--stages", "2", "--local-nodes", "5",
                          "--redundancy", "off", "--preempt", "1@2:5", "--check-replicas", "--max-stages-per-node", "1",
                          "--surplus", "keep")
    assert [r["iteration"] for r in got] == list(range(8))
    assert losses(got) == pytest.approx(losses(reference), rel=1e-9)
    assert {"redo", "preemption", "reconfigure"} <= events(got, 2)
    assert all(r["replicas_equal"] for r in got)


@pytest.mark.slow
def test_lazy_with_agents_recovers_inside_the_iteration(tmp_path, reference):
    """Lazy: node 1's predecessor runs stage 1's forward and backward after the
    death and finishes iteration 2 (a failover, no redo); the standby takes the
    stage at the boundary and replicas are whole again."""
    _, got = bamboo_train(tmp_path / "lazy.jsonl", *COMMON, "--stages", "2", "--local-nodes", "5",
                          "--redundancy", "lazy", "--preempt", "1@2:5", "--check-replicas",
                          "--max-stages-per-node", "1", "--surplus", "keep")
    assert losses(got) == pytest.approx(losses(reference), rel=1e-9)
    assert "failover" in events(got, 2) and "redo" not in events(got, 2)
    assert "reconfigure" in events(got, 3)
    assert all(r["replicas_equal"] for r in got)


@pytest.mark.slow  # make test-slow: 80 s here; the mode choice itself is tests/unit/agents/test_mode_choice.py
def test_auto_starts_without_redundancy_and_switches_live_after_a_death(tmp_path, reference):
    """--redundancy auto assuming no preemptions: the agents start with off (two
    pipelines). Node 1's death costs a redo; the agents see a preemption rate at
    which a replica pays and switch at a boundary, building the replicas through
    the handover; the losses stay the reference's and replicas equal owners."""
    _, got = bamboo_train(tmp_path / "auto.jsonl", *COMMON, "--stages", "2",
                          "--local-nodes", "5", "--redundancy", "auto", "--auto-prior-rate", "0",
                          "--auto-prior-hours", "0.00001", "--preempt", "1@3:5", "--check-replicas",
                          "--surplus", "keep")
    assert losses(got) == pytest.approx(losses(reference), rel=1e-9)
    modes = [e for r in got for e in r["events"] if e["type"] == "reconfigure"]
    assert modes[0]["redundancy"] == "off"
    assert "redo" in events(got, 3)
    switches = [e for r in got[4:] for e in r["events"] if e["type"] == "mode"]
    assert switches and switches[0]["from"] == "off" and switches[0]["to"] in ("eager", "lazy")
    assert all(r["replicas_equal"] for r in got)


@pytest.mark.slow
def test_auto_with_the_sync_in_the_next_iteration_keeps_a_replica_and_survives(tmp_path, reference):
    """--redundancy auto with --replica-sync next (one pipeline, a node in standby):
    with the sync off the critical path a replica costs off's iteration, so even
    with no preemption assumed auto runs eager from the start (agents.modes weighs
    the late-sync schedules, a death in a sync's window as a rollback). Node 1 and
    then its replacement die mid-iteration, past their syncs of the iteration
    before: each is taken over inside its iteration, and the losses stay the
    reference's."""
    _, got = bamboo_train(tmp_path / "auto.jsonl", *COMMON, "--stages", "2", "--local-nodes", "3",
                          "--redundancy", "auto", "--replica-sync", "next", "--checkpoint", str(tmp_path / "ck"),
                          "--checkpoint-every", "2", "--auto-prior-rate", "0", "--auto-prior-hours", "0.00001",
                          "--preempt", "1@3:5", "--preempt", "2@6:12", "--surplus", "keep")
    assert losses(got) == pytest.approx(losses(reference), rel=1e-9)
    assert [e for e in got[0]["events"] if e["type"] == "reconfigure"][0]["redundancy"] == "eager"
    assert "failover" in events(got, 3) and "failover" in events(got, 6)
    assert not any(e["type"] in ("mode", "redo") for r in got for e in r["events"])


@pytest.mark.slow  # make test-slow: the choice itself is tests/unit/agents/test_mode_choice.py's
def test_the_agents_choose_the_sync_and_move_it_to_the_end_after_a_death_in_its_window(tmp_path, reference):
    """--redundancy eager --replica-sync auto (one pipeline of whole stages, a node in
    standby): with
    no preemption assumed the agents take the sync in the next iteration (its
    iteration is the shorter). Node 1 is killed in iteration 3 before its sync of
    iteration 2 left: the replica is a step behind, so the job goes back to the
    checkpoint before iteration 2. What that death cost makes the sync at the end
    the cheaper, and a later epoch runs it, its replicas sent again from their
    owners. The losses stay the reference's."""
    _, got = bamboo_train(tmp_path / "sync.jsonl", *COMMON, "--stages", "2", "--local-nodes", "3",
                          "--redundancy", "eager", "--replica-sync", "auto", "--checkpoint", str(tmp_path / "ck"),
                          "--checkpoint-every", "2", "--auto-prior-rate", "0", "--auto-prior-hours", "0.00001",
                          "--preempt", "1@3:0", "--surplus", "keep", "--max-stages-per-node", "1")
    final = list({r["iteration"]: r for r in got}.values())
    assert losses(final) == pytest.approx(losses(reference), rel=1e-9)
    assert redos(got) == [
        {"type": "redo", "abandoned": 3, "from": 2, "restore": "checkpoint"}]
    epochs = [e for r in got for e in r["events"] if e["type"] == "reconfigure"]
    assert epochs[0]["sync"] == "next" and epochs[-1]["sync"] == "end"
    assert all(e["redundancy"] == "eager" for e in epochs)
    switches = [e for r in got for e in r["events"] if e["type"] == "mode"]
    assert switches and switches[0]["from"] == "eager+next" and switches[-1]["to"] == "eager"


@pytest.mark.parametrize("args, named", [
    (["--stages", "2", "--redundancy", "off", "--preempt", "1@1:3"], "no agents"),
    (["--stages", "2", "--redundancy", "off", "--local-nodes", "3"], "2 pipelines"),
    (["--stages", "2", "--redundancy", "auto"], "needs agents"),
    (["--stages", "2", "--redundancy", "auto", "--local-nodes", "4", "--auto-prior-hours", "0"], "--auto-prior-hours"),
    (["--stages", "2", "--replica-sync", "sometimes", "--local-nodes", "3"], "--replica-sync"),
])
def test_off_where_a_death_cannot_be_survived_is_refused(tmp_path, args, named, capsys):
    status, err = train_refusal(capsys, "--no-progress", "--metrics-out", str(tmp_path / "m.jsonl"), *args)
    assert status == 2 and err.strip().count("\n") == 0 and named in err, err
    assert not (tmp_path / "m.jsonl").exists()
