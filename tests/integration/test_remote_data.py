"""--data from object storage: a token file in moto's S3 or the fake Cloud Storage
trains exactly as the same file given as a local path, each machine downloads it
once (later runs and concurrent workers reuse the copy), a download cut short
leaves no file, and a bad URI or missing object is one line and status 2."""
import os
import signal
import threading

import numpy as np
import pytest

from bamboo.data.cache import local_copy
from bamboo.data.corpus import ByteCorpus, TokenFile
from tests.training import bamboo_train

TRAIN = ["--stages", "2", "--microbatches", "4", "--iterations", "3", "--dtype", "float64"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A token file (ids < 256, tiny's vocabulary), and the losses of a run on it as a local path."""
    root = tmp_path_factory.mktemp("local")
    path = root / "tokens.bin"
    np.random.default_rng(3).integers(0, 256, 6000).astype(np.uint16).tofile(path)
    return path, [r["loss"] for r in bamboo_train(root / "m.jsonl", *TRAIN, "--data", str(path))[1]]


def media_gets(fake) -> int:
    return sum(1 for r in fake.requests if r == ("GET", "media"))


@pytest.mark.slow
def test_s3_data_trains_as_the_local_file(tmp_path, s3, tokens):
    path, local = tokens
    s3.create_bucket(Bucket="data")
    s3.upload_file(str(path), "data", "corpus/tokens.bin")
    run = bamboo_train(tmp_path / "m.jsonl", *TRAIN, "--data", "s3://data/corpus/tokens.bin")[1]
    assert [r["loss"] for r in run] == pytest.approx(local, rel=1e-12) and len(local) == 3
    gets = []
    s3.meta.events.register("before-call.s3.GetObject", lambda **kw: gets.append(kw))
    copy = local_copy("s3://data/corpus/tokens.bin", s3)  # the run's copy, reused: metadata only
    assert open(copy, "rb").read() == path.read_bytes() and not gets


@pytest.mark.slow
def test_gcs_data_trains_as_the_local_file_and_is_downloaded_once(tmp_path, gcs, tokens):
    """A run of a launcher and two workers, then a single-process one (the reference,
    equal to the pipeline within 1e-9 in float64), all reading the data: one download."""
    path, local = tokens
    gcs.put("data", "tokens.bin", path.read_bytes())
    run = bamboo_train(tmp_path / "m0.jsonl", *TRAIN, "--data", "gs://data/tokens.bin")[1]
    assert [r["loss"] for r in run] == pytest.approx(local, rel=1e-12)
    assert media_gets(gcs) == 1
    single = ["--stages", "1", "--pipelines", "1", *TRAIN[2:]]
    again = bamboo_train(tmp_path / "m1.jsonl", *single, "--data", "gs://data/tokens.bin")[1]
    assert [r["loss"] for r in again] == pytest.approx(local, rel=1e-9)
    assert media_gets(gcs) == 1 and gcs.requests.count(("GET", "metadata")) >= 4


def test_text_from_gcs_is_the_same_corpus(tmp_path, gcs):
    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    gcs.put("data", "text/a.txt", text.read_bytes())
    remote = ByteCorpus([local_copy("gs://data/text/a.txt")], seq=16, batch=2, seed=1)
    assert np.array_equal(remote.tokens, ByteCorpus([text], seq=16, batch=2, seed=1).tokens)


def test_concurrent_workers_download_once(gcs):
    gcs.put("data", "t.bin", bytes(range(256)) * 64)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(local_copy("gs://data/t.bin"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(paths) == 6 and media_gets(gcs) == 1


def test_a_changed_object_is_fetched_again_and_the_old_copy_dropped(gcs):
    gcs.put("data", "t.bin", b"\x01\x00" * 100)
    old = local_copy("gs://data/t.bin")
    gcs.put("data", "t.bin", b"\x02\x00" * 300)  # a new generation
    new = local_copy("gs://data/t.bin")
    assert new != old and not os.path.exists(old) and open(new, "rb").read() == b"\x02\x00" * 300
    assert media_gets(gcs) == 2


def test_a_download_cut_short_leaves_no_file(gcs, monkeypatch):
    """A failure mid-write leaves nothing at the copy's path; the temp file a SIGKILL
    would leave is ignored, then removed by the next download."""
    from bamboo.data.objects import GcsBucket
    data = bytes(range(256)) * 64
    gcs.put("data", "t.bin", data)
    real = GcsBucket.download

    def half(self, key, stat, out):
        out.write(data[:1000])
        raise ConnectionResetError("cut")
    monkeypatch.setattr(GcsBucket, "download", half)
    with pytest.raises(ConnectionResetError):
        local_copy("gs://data/t.bin")
    cache = os.environ["BAMBOO_DATA_CACHE"]
    files = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f != ".lock"]
    assert files == []
    (version,) = [d for d, subdirs, _ in os.walk(cache) if not subdirs]  # the folder of this object's version
    open(os.path.join(version, "tmpkilled.part"), "wb").write(data[:500])  # as a SIGKILL leaves it
    monkeypatch.setattr(GcsBucket, "download", real)
    path = local_copy("gs://data/t.bin")
    assert open(path, "rb").read() == data and os.listdir(version) == ["t.bin"]


def bad_cases(tmp_path):
    return [
        (["--data", "gs://nope/t.bin"], "gs://nope/t.bin: cannot read it: no such bucket"),
        (["--data", "gs://data/missing.bin"], "gs://data/missing.bin: no such object"),
        (["--data", "gs://data/"], "gs://data/ holds no token shards (*.tok)"),
        (["--data", "s3://nope/t.bin"], "s3://nope/t.bin: cannot read it: no such bucket"),
        (["--data", "s3://data/missing.bin"], "s3://data/missing.bin: no such object"),
        (["--data", "s3://"], "expected s3://BUCKET/KEY"),
        (["--data", "gs://data/odd.bin"], "token file gs://data/odd.bin has 3 bytes"),
        (["--stages", "2", "--checkpoint", "gs://nope/ck"], "gs://nope/ck/: cannot list it: no such bucket"),
        (["--stages", "2", "--checkpoint", "s3://nope/ck"], "s3://nope/ck/: cannot list it: NoSuchBucket"),
    ]


@pytest.mark.parametrize("index", range(9))
def test_bad_uris_give_one_line_and_status_2(tmp_path, gcs, s3, capsys, index):
    from commands.train.cli import main
    s3.create_bucket(Bucket="data")
    gcs.put("data", "odd.bin", b"\x01\x02\x03")
    args, message = bad_cases(tmp_path)[index]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--no-progress", "--iterations", "1", *args, "--metrics-out", str(tmp_path / "m.jsonl")])
    finally:
        signal.signal(signal.SIGTERM, handler)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "m.jsonl").exists()


def test_an_unreachable_endpoint_is_one_line(tmp_path, s3, monkeypatch, capsys):
    from commands.train.cli import main
    monkeypatch.setenv("BAMBOO_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--no-progress", "--data", "s3://data/t.bin"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "s3://data/t.bin: cannot read it: Could not connect" in lines[0], lines


def test_a_token_file_read_from_a_local_copy_names_the_object(gcs):
    gcs.put("data", "w.bin", np.array([1, 300, 2] * 20, np.uint16).tobytes())
    corpus = TokenFile(local_copy("gs://data/w.bin"), "uint16", 8, 1, 0, 0.0, name="gs://data/w.bin")
    with pytest.raises(ValueError, match=r"token file gs://data/w.bin: token id 300 at position 1"):
        corpus.check_vocabulary(256, "tiny")
