"""bamboo-data --out s3://BUCKET/PREFIX: the shards a directory would get, uploaded
to moto's S3 whole; a rerun into the prefix and a missing bucket are one line."""
import pytest

from commands.data.tokenize import main
from tests.sample_tokenizer import save_tokenizer
from tests.unit.commands.test_data_command import DOCS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    directory = save_tokenizer(tmp_path_factory.mktemp("tok"))
    return directory, AutoTokenizer.from_pretrained(directory)


def test_shards_go_to_a_bucket_prefix_whole_and_a_second_run_is_refused(tmp_path, tokenizer, s3, capsys):
    """--out s3://...: the same shards as a directory gets, uploaded; the ids read
    back from the bucket are the tokenizer's. A rerun into the prefix is refused."""
    directory, tok = tokenizer
    (tmp_path / "a.txt").write_text(DOCS[2])
    s3.create_bucket(Bucket="corpus")
    argv = ["--tokenizer", directory, "--shard-tokens", "64", str(tmp_path / "a.txt")]
    assert main([*argv, "--out", "s3://corpus/data/llama/"]) == 0
    assert "uploaded" in capsys.readouterr().out
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="corpus")["Contents"])
    assert keys and all(k.startswith("data/llama/train-") and k.endswith(".tok") for k in keys)
    local = tmp_path / "local"
    assert main([*argv, "--out", str(local)]) == 0
    assert [p.name for p in sorted(local.glob("*.tok"))] == [k.rpartition("/")[2] for k in keys]
    for key in keys:  # byte for byte what the local run wrote
        assert s3.get_object(Bucket="corpus", Key=key)["Body"].read() == (local / key.rpartition("/")[2]).read_bytes()
    capsys.readouterr()
    assert main([*argv, "--out", "s3://corpus/data/llama"]) == 2
    err = capsys.readouterr().err
    assert "already holds shards named train" in err and err.count("\n") == 1


def test_a_bucket_that_does_not_exist_is_one_line(tmp_path, tokenizer, s3, capsys):
    directory, _ = tokenizer
    (tmp_path / "a.txt").write_text(DOCS[0])
    assert main(["--tokenizer", directory, "--out", "s3://no-such-bucket/x", str(tmp_path / "a.txt")]) == 2
    err = capsys.readouterr().err
    assert "no-such-bucket" in err and err.count("\n") == 1


def test_an_upload_that_fails_halfway_leaves_no_shard(tmp_path, tokenizer, s3, capsys, monkeypatch):
    """The store refuses the second shard: the first, uploaded already, is removed."""
    from bamboo.data.objects import ObjectError, S3Bucket
    directory, _ = tokenizer
    (tmp_path / "a.txt").write_text(DOCS[2])
    s3.create_bucket(Bucket="corpus-halfway")  # moto's server outlives a test: a bucket of its own
    put, calls = S3Bucket.put, []

    def failing_second(self, key, data):
        calls.append(key)
        if len(calls) == 2:
            raise ObjectError(f"s3://corpus-halfway/{key}: access denied")
        put(self, key, data)
    monkeypatch.setattr(S3Bucket, "put", failing_second)
    argv = ["--tokenizer", directory, "--shard-tokens", "64", "--out", "s3://corpus-halfway/data",
            str(tmp_path / "a.txt")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "access denied" in err and err.count("\n") == 1
    assert len(calls) == 2 and "Contents" not in s3.list_objects_v2(Bucket="corpus-halfway")
