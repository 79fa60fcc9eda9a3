"""The validation loss (--eval-every) computed on the pipeline, forward only, with
real worker processes: equal to the single-process reference's, leaving training
bit for bit as it is without evaluations, and surviving a SIGKILL in the middle
of an evaluation (that evaluation is skipped, training goes on)."""
import os

import numpy as np
import pytest
import torch

from commands.train.reference import train_reference, validation_loss
from bamboo.control.config import JobConfig
from tests.training import bamboo_train

ITERS = 5
EVALUATED = [1, 3, 4]  # every 2nd iteration, and the last
RTOL = 1e-9


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A nanoGPT-style token file: flat uint16 ids of the tiny model's vocabulary."""
    path = tmp_path_factory.mktemp("data") / "train.bin"
    np.random.default_rng(0).integers(0, 256, 40_000).astype(np.uint16).tofile(path)
    return path


@pytest.fixture(scope="module")
def val_file(tokens):
    """nanoGPT's val.bin beside train.bin: validation on a file of its own."""
    path = tokens.parent / "val.bin"
    np.random.default_rng(1).integers(0, 256, 4_000).astype(np.uint16).tofile(path)
    return path


def common(tokens):
    return ["--model", "tiny", "--dtype", "float64", "--microbatches", "4", "--iterations", str(ITERS),
            "--seed", "3", "--data", str(tokens), "--eval-batches", "4"]


def train(tmp_path, tokens, name, *args):
    params = tmp_path / f"{name}-params"
    _, records = bamboo_train(tmp_path / f"{name}.jsonl", *common(tokens), "--save-dir", str(params), *args)
    return records, params


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokens):
    return train(tmp_path_factory.mktemp("reference"), tokens, "reference", "--stages", "1", "--eval-every", "2")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tokens):
    """P=2, D=2: each pipeline evaluates half of the validation microbatches."""
    return train(tmp_path_factory.mktemp("evaluated"), tokens, "p2d2", "--stages", "2", "--pipelines", "2",
                 "--eval-every", "2")


def assert_same(got, want, skipped=()):
    (records, params), (ref_records, ref_params) = got, want
    assert [r["iteration"] for r in records] == list(range(ITERS))
    for a, b in zip(records, ref_records):
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL), a["iteration"]
        assert ("val_loss" in b) == (b["iteration"] in EVALUATED), b
        if a["iteration"] in skipped or a["iteration"] not in EVALUATED:
            assert "val_loss" not in a, a
        else:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=RTOL), a["iteration"]
    for f in os.listdir(ref_params):
        a, b = torch.load(ref_params / f), torch.load(params / f)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=1e-12)


def test_the_reference_evaluates_without_changing_its_training(tokens):
    cfg = JobConfig.of(name="tiny", dtype="float64", microbatches=4, iterations=3, seed=3, data_files=(str(tokens),),
                       eval_every=1, eval_batches=4)
    plain, with_eval, vals = {}, {}, {}
    train_reference(cfg.with_(eval_every=0), plain.__setitem__)
    model = train_reference(cfg, with_eval.__setitem__, vals.__setitem__)
    assert plain == with_eval and sorted(vals) == [0, 1, 2]
    from bamboo.data.corpus import corpus_of
    corpus = corpus_of(cfg, 32)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert validation_loss(model, corpus, cfg) == vals[2]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.training and all(m.training for m in model.modules()) and torch.equal(rng, torch.get_rng_state())


@pytest.mark.slow
def test_val_loss_on_the_pipeline_equals_the_reference(evaluated, reference):
    assert_same(evaluated, reference)


@pytest.mark.slow
def test_evaluation_leaves_training_bit_equal(tmp_path, tokens, evaluated):
    records, params = train(tmp_path, tokens, "plain", "--stages", "2", "--pipelines", "2")
    assert [r["loss"] for r in records] == [r["loss"] for r in evaluated[0]]
    assert not any("val_loss" in r for r in records)
    for f in os.listdir(params):
        a, b = torch.load(params / f), torch.load(evaluated[1] / f)
        assert all(torch.equal(a[k], b[k]) for k in a), f


@pytest.mark.slow
def test_a_node_killed_during_an_evaluation(tmp_path, tokens, val_file):
    """P=4, validating on val.bin: node 2 dies before its 5th evaluation instruction
    after iteration 3. That evaluation is cut short on the pipeline and recorded as
    skipped; the boundary handles the death as one between iterations, and
    iteration 4 trains and evaluates on three nodes (node 1 runs stages 1 and 2),
    as the reference."""
    files = ["--eval-every", "2", "--val-data", str(val_file)]
    reference = train(tmp_path, tokens, "reference", "--stages", "1", *files)
    got = train(tmp_path, tokens, "kill", "--stages", "4", *files, "--preempt", "2@3:eval4")
    assert_same(got, reference, skipped=[3])
    records = got[0]
    events = {e["type"]: e for e in records[3]["events"]}
    assert set(events) == {"preemption", "eval_skipped"} and events["preemption"]["node"] == 2
    assert events["eval_skipped"]["arrived"] < 4
    assert [r["nodes"] for r in records] == [4, 4, 4, 3, 3]


@pytest.mark.slow  # make test-slow: the same death under agents, a standby node takes the stage
def test_a_node_killed_during_an_evaluation_is_replaced_by_a_standby_node(tmp_path, tokens, reference):
    got = train(tmp_path, tokens, "agents", "--stages", "4", "--local-nodes", "5", "--eval-every", "2",
                "--max-stages-per-node", "1", "--preempt", "2@3:eval4", "--surplus", "keep")
    assert_same(got, reference, skipped=[3])
    assert any(e["type"] == "reconfigure" for e in got[0][4]["events"])
