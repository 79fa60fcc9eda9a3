"""bamboo-export on a real job's checkpoints in S3 (moto): the model it writes is,
tensor for tensor, the one the run's own --export wrote from its final parameters."""
import json

import pytest
from safetensors.torch import load_file

from tests.training import bamboo_train


@pytest.mark.slow  # make test-slow: test_hf.py exports a run and loads it with from_pretrained in make test
@pytest.mark.parametrize("model", ["hf:llama-tiny"])
def test_a_checkpoint_in_s3_exports_the_model_the_run_exported(tmp_path, s3, model):
    from commands.train.export import main
    s3.create_bucket(Bucket="ckpts")
    bamboo_train(tmp_path / "m.jsonl", "--model", model, "--seq", "16", "--dtype", "float64", "--stages", "2",
                 "--microbatches", "2", "--iterations", "4", "--checkpoint", "s3://ckpts/job",
                 "--checkpoint-every", "2", "--export", str(tmp_path / "run"))
    assert main(["--checkpoint", "s3://ckpts/job", str(tmp_path / "out")]) == 0
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(ours[k].equal(theirs[k]) for k in ours)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads((tmp_path / "run" / "config.json").read_text())
    assert main(["--checkpoint", "s3://ckpts/job", "--iteration", "2", str(tmp_path / "mid")]) == 0
    mid = load_file(tmp_path / "mid" / "model.safetensors")
    assert any(not mid[k].equal(ours[k]) for k in ours)  # two steps earlier
