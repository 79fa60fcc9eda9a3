"""Token shards in use: a pipeline trained on a directory of shards equals the
single-process run on the same ids in one raw file; shards in a bucket are checked
against the model at launch from their headers (ranged reads, nothing downloaded)."""
import os

import numpy as np
import pytest

from bamboo.data.shards import write_shard
from tests.training import bamboo_train

IDS = np.random.default_rng(8).integers(0, 256, 7_000)  # tiny's vocabulary
TRAIN = ["--stages", "2", "--microbatches", "4", "--iterations", "3", "--dtype", "float64"]


def write_shards(directory, ids=IDS, vocab=256, cuts=(1_000, 4_500)) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths, start = [], 0
    for i, end in enumerate((*cuts, len(ids))):
        paths.append(os.path.join(directory, f"train-{i:05d}.tok"))
        write_shard(paths[-1], ids[start:end], "bytes", vocab)
        start = end
    return paths


def test_a_pipeline_on_a_directory_of_shards_equals_one_process_on_the_raw_ids(tmp_path):
    """The reference runs here, in this process, on one raw file of the same ids."""
    from bamboo.control.config import JobConfig
    from commands.train.reference import mean_loss, train_reference
    write_shards(tmp_path / "shards")
    raw = tmp_path / "all.bin"
    IDS.astype(np.uint16).tofile(raw)
    run = bamboo_train(tmp_path / "m.jsonl", *TRAIN, "--val-fraction", "0.1", "--data", str(tmp_path / "shards"))[1]
    reference = {}
    train_reference(JobConfig.of(microbatches=4, iterations=3, dtype="float64", val_fraction=0.1,
                                 data_files=(str(raw),)), lambda it, losses: reference.__setitem__(it, losses))
    assert len(run) == 3 and [r["loss"] for r in run] == pytest.approx(
        [mean_loss(reference[i], 4) for i in range(3)], rel=1e-9)


def upload(put, prefix: str, paths: list[str]) -> list[str]:
    uris = []
    for p in paths:
        put(f"{prefix}{os.path.basename(p)}", open(p, "rb").read())
        uris.append(os.path.basename(p))
    return uris


def launch_config(data: str):
    from cloud.job import job_config
    return job_config(["--model", "tiny", "--stages", "2", "--microbatches", "4", "--data", data], 4, "shards")


def test_shards_in_s3_are_checked_from_their_headers(tmp_path, s3, monkeypatch):
    from bamboo.data.objects import S3Bucket
    from cloud.common import BadInput
    s3.create_bucket(Bucket="data")
    reads, real = [], S3Bucket.get_start
    monkeypatch.setattr(S3Bucket, "get_start", lambda self, key, size: reads.append(size) or real(self, key, size))
    monkeypatch.setattr(S3Bucket, "get", lambda *a: pytest.fail("a shard was read whole"))
    monkeypatch.setattr(S3Bucket, "download", lambda *a: pytest.fail("a shard was downloaded"))
    names = upload(lambda k, b: s3.put_object(Bucket="data", Key=k, Body=b), "fit/", write_shards(tmp_path / "fit"))
    s3.put_object(Bucket="data", Key="fit/notes.txt", Body=b"not a shard")
    cfg = launch_config("s3://data/fit/")
    assert cfg.data.data_files == tuple(f"s3://data/fit/{n}" for n in names) and len(reads) == 3
    upload(lambda k, b: s3.put_object(Bucket="data", Key=k, Body=b), "wide/",
           write_shards(tmp_path / "wide", ids=IDS + 40_000, vocab=50_257))
    with pytest.raises(BadInput, match=r"token shards s3://data/wide/train-00000.tok .. \(3\): ids up to "
                                       r"\d+ \(tokenizer bytes\) are outside model tiny's vocabulary of 256"):
        launch_config("s3://data/wide/")
    assert not os.path.exists(tmp_path / "cache")


def test_shards_in_cloud_storage_are_checked_from_their_headers(tmp_path, gcs):
    from cloud.common import BadInput
    paths = write_shards(tmp_path / "fit")
    upload(lambda k, b: gcs.put("data", k, b), "fit/", paths)
    cfg = launch_config("gs://data/fit/")
    assert len(cfg.data.data_files) == 3 and gcs.requests.count(("GET", "media")) == 3  # one ranged read each
    cut = open(paths[1], "rb").read()[:-2]
    gcs.put("data", "cut/train-00000.tok", cut)
    with pytest.raises(BadInput, match="token shard gs://data/cut/train-00000.tok: .* cut short or appended to"):
        launch_config("gs://data/cut/")
    assert not os.path.exists(tmp_path / "cache")
