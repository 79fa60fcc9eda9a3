"""bamboo-export from a checkpoint directory: the model transformers loads gives the
logits of the checkpoint's layers run in order; the model comes from the commit
record or from the flags; a checkpoint that cannot be exported is one line."""
import json
from dataclasses import asdict

import pytest
import torch

from bamboo.control.config import ModelSpec
from bamboo.data.checkpoint_files import Attempt, LocalStorage, write_part
from bamboo.model.api import ModelSource
from bamboo.state.checkpoint import snapshot
from commands.train.export import main

SPEC = ModelSpec(name="hf:llama-tiny", seed=4, dtype="float64", seq=16)


def checkpoint(root, iteration: int, spec: ModelSpec = SPEC, scale: float = 1.0, record_model: bool = True):
    """A checkpoint of `spec`'s layers (their first values times `scale`), as workers write one."""
    source = ModelSource.of(spec)
    layers = {i: source.layer(i) for i in range(source.count)}
    with torch.no_grad():
        for layer in layers.values():
            for p in layer.parameters():
                p.mul_(scale)
    blobs = snapshot(layers, torch.optim.AdamW([p for layer in layers.values() for p in layer.parameters()]))
    extra = {"model": asdict(spec)} if record_model else None
    assert write_part(LocalStorage(str(root)), Attempt(iteration, "run-e000001"), 0, blobs, extra, source.count)
    return [layers[i] for i in range(source.count)]


def logits(layers, tokens):
    h = tokens
    with torch.no_grad():
        for layer in layers:
            h = layer.eval()(h)
    return h


def test_the_exported_model_gives_the_checkpoint_s_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    checkpoint(tmp_path / "ck", 2, scale=0.5)
    newest = checkpoint(tmp_path / "ck", 4, scale=1.5)
    assert main(["--checkpoint", str(tmp_path / "ck"), str(tmp_path / "out")]) == 0
    assert "from the checkpoint taken before iteration 4" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert model.dtype == torch.float64
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, logits(newest, tokens), rtol=1e-12, atol=1e-12)


def test_an_older_checkpoint_by_iteration_and_one_that_names_no_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    older = checkpoint(tmp_path / "ck", 2, scale=0.5, record_model=False)
    checkpoint(tmp_path / "ck", 4)
    args = ["--checkpoint", str(tmp_path / "ck"), "--iteration", "2", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not name its model" in err[0] and "--model" in err[0]
    assert main(args + ["--model", "hf:llama-tiny", "--seq", "16", "--dtype", "float64"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, logits(older, tokens), rtol=1e-12, atol=1e-12)


def bad_cases(tmp_path):
    checkpoint(tmp_path / "ck", 4)
    commit = next((tmp_path / "ck").glob("ckpt-*/commit.json"))
    (tmp_path / "bad").mkdir()
    for path in commit.parent.iterdir():
        (tmp_path / "bad" / commit.parent.name).mkdir(exist_ok=True)
        (tmp_path / "bad" / commit.parent.name / path.name).write_bytes(path.read_bytes())
    record = json.loads(commit.read_text())
    (tmp_path / "bad" / commit.parent.name / "commit.json").write_text(json.dumps({**record, "model": {"name": 5}}))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    ck = str(tmp_path / "ck")
    return [
        (["--checkpoint", ck, "--iteration", "3", str(tmp_path / "o")],
         "no complete checkpoint taken before iteration 3"),
        (["--checkpoint", ck, "--model", "hf:gpt2-tiny", str(tmp_path / "o")], "is not model hf:gpt2-tiny's"),
        (["--checkpoint", str(tmp_path / "bad"), str(tmp_path / "o")], "its record of the model is not one"),
        (["--checkpoint", ck, str(tmp_path / "taken")], "OUT"),
        (["--checkpoint", str(tmp_path / "none"), str(tmp_path / "o")], "no complete checkpoint at all"),
    ]


@pytest.mark.parametrize("index", range(5))
def test_what_cannot_be_exported_is_one_line_and_status_2(tmp_path, capsys, index):
    args, why = bad_cases(tmp_path)[index]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bamboo-export: error: ") and why in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_wrong_dtype_given_for_an_older_checkpoint_is_refused(tmp_path, capsys):
    checkpoint(tmp_path / "ck", 2, record_model=False)
    assert main(["--checkpoint", str(tmp_path / "ck"), "--model", "hf:llama-tiny", "--seq", "16",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds torch.float64 weights, not --dtype float32's" in err[0], err
    assert not (tmp_path / "out").exists()
