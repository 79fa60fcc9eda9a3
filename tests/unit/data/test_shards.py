"""Token shards: the header read as untrusted input, several shards read as one
stream (compared with the same ids in one raw token file), the vocabulary checked
from the headers, and what may be mixed in --data."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bamboo.data.corpus import DataError, TokenShards, corpora, expand, open_corpus
from bamboo.data.shards import HEAD_BYTES, MAGIC, ShardError, ShardHeader, read_header, write_shard

IDS = np.random.default_rng(5).integers(0, 50_000, 9_000)


def shards(directory, cuts=(2_000, 2_001, 7_500), vocab=50_257, tokenizer="gpt2") -> list[str]:
    paths, start = [], 0
    for i, end in enumerate((*cuts, len(IDS))):
        paths.append(str(directory / f"train-{i:05d}.tok"))
        write_shard(paths[-1], IDS[start:end], tokenizer, vocab)
        start = end
    return paths


def test_shards_read_as_the_same_stream_as_one_raw_token_file(tmp_path):
    """Windows that span two shards (and a shard of one id) are drawn as from one file."""
    paths = shards(tmp_path)
    raw = tmp_path / "all.bin"
    IDS.astype(np.uint16).tofile(raw)
    stream = open_corpus(paths, "uint16", 64, 3, 11, 0.1)
    reference = open_corpus([str(raw)], "uint16", 64, 3, 11, 0.1)
    assert stream.train_end == reference.train_end == 8_100
    for i in range(200):
        for got, want in zip(stream.microbatch(i, i % 5) + stream.validation(i), reference.microbatch(i, i % 5)
                             + reference.validation(i)):
            assert torch_equal(got, want)


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_the_header_holds_what_was_written(tmp_path):
    path = tmp_path / "s.tok"
    header = write_shard(str(path), np.array([7, 70_000, 3]), "meta-llama/Llama-3.2-1B", 128_256)
    assert read_header(str(path)) == header == ShardHeader("uint32", 128_256, "meta-llama/Llama-3.2-1B", 3, 70_000)
    assert path.stat().st_size == header.offset + 12 and header.offset % 64 == 0
    assert np.fromfile(path, dtype="<u4", offset=header.offset).tolist() == [7, 70_000, 3]
    assert not list(tmp_path.glob("*.tmp"))


def frame(fields: dict) -> bytes:
    body = json.dumps(fields).encode()
    return MAGIC + len(body).to_bytes(4, "little") + body


GOOD = {"dtype": "uint16", "vocab": 300, "tokenizer": "t", "tokens": 4, "max_id": 299, "version": 1}


@pytest.mark.parametrize("head,why", [
    (b"\x01\x02" * 40, "not a token shard"),
    (MAGIC + (1 << 20).to_bytes(4, "little"), "cut short or over"),
    (MAGIC + (5).to_bytes(4, "little") + b"{nope", "not JSON"),
    (frame({**GOOD, "extra": 1}), "header fields are not"),
    (frame({**GOOD, "vocab": True}), "wrong type"),
    (frame({**GOOD, "dtype": ["uint16"]}), "wrong type"),
    (frame({**GOOD, "dtype": "float32"}), "this reader knows"),
    (frame({**GOOD, "vocab": 70_000}), "does not fit uint16"),
    (frame({**GOOD, "max_id": 300}), "out of range"),
    (frame({**GOOD, "tokens": -1}), "out of range"),
    (MAGIC + (5000).to_bytes(4, "little") + b"[" * 5000, "not JSON"),  # nested past the parser's depth
])
def test_a_bad_header_is_refused_by_what_is_wrong(head, why):
    with pytest.raises(ShardError, match=why):
        ShardHeader.parse(head)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_any_bytes_parse_to_a_valid_header_or_a_shard_error(data, framed):
    """Nothing but ShardError escapes, whatever a file or an object holds."""
    head = MAGIC + len(data).to_bytes(4, "little") + data if framed else data
    try:
        header = ShardHeader.parse(head)
    except ShardError:
        return
    assert -1 <= header.max_id < header.vocab and header.tokens >= 0


@pytest.mark.parametrize("change,why", [(lambda b: b[:-1], "cut short or appended"),
                                        (lambda b: b + b"\0\0", "cut short or appended")])
def test_a_shard_whose_size_breaks_its_header_s_promise_is_refused(tmp_path, change, why):
    path = tmp_path / "s.tok"
    write_shard(str(path), IDS[:100], "gpt2", 50_257)
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(DataError, match=f"token shard {path}: .*{why}"):
        open_corpus([str(path)], "uint16", 8, 1, 0, 0.0)


def test_a_header_that_understates_its_largest_id_is_refused(tmp_path):
    path = tmp_path / "s.tok"
    header = write_shard(str(path), IDS[:100], "gpt2", 50_257)
    lying = ShardHeader(header.dtype, header.vocab, header.tokenizer, header.tokens, 10)
    data = path.read_bytes()
    assert len(lying.to_bytes()) == header.offset
    path.write_bytes(lying.to_bytes() + data[header.offset:])
    with pytest.raises(DataError, match="holds ids above the largest its header names \\(10\\)"):
        open_corpus([str(path)], "uint16", 8, 1, 0, 0.0).check_vocabulary(50_257, "hf:gpt2")


def test_training_and_validation_shards_share_no_file_and_one_tokenizer(tmp_path):
    from argparse import Namespace
    from bamboo.model.api import ModelSource
    from commands.train.cli import check_data
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = shards(tmp_path / "a"), shards(tmp_path / "b", tokenizer="other")
    args = Namespace(data=[str(tmp_path / "a")], val_data=[a[-1]], val_fraction=None, eval_every=0,
                     eval_batches=1, token_dtype="uint16", batch=1, seed=0, model="m", model_config=None)
    with pytest.raises(ValueError, match=f"--data and --val-data both name {a[-1]}: validation would see"):
        check_data(args, ModelSource("tiny", 0))
    with pytest.raises(DataError, match="different tokenizers"):
        corpora(a[:2], b[:1], "uint16", 8, 1, 0, 0.0)


def test_the_vocabulary_is_checked_from_the_headers(tmp_path):
    corpus = open_corpus(shards(tmp_path), "uint16", 8, 1, 0, 0.0)
    assert isinstance(corpus, TokenShards)
    corpus.check_vocabulary(int(IDS.max()) + 1, "m")  # the largest id fits exactly
    with pytest.raises(DataError, match=f"ids up to {IDS.max()} .* outside model hf:llama-1b's vocabulary of 32000"):
        corpus.check_vocabulary(32_000, "hf:llama-1b")


def test_shards_of_two_tokenizers_text_with_shards_and_binary_text_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = shards(tmp_path / "a"), shards(tmp_path / "b", tokenizer="other")
    with pytest.raises(DataError, match="different tokenizers"):
        open_corpus([a[0], b[1]], "uint16", 8, 1, 0, 0.0)
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 100)
    with pytest.raises(DataError, match="cannot be mixed"):
        open_corpus([a[0], str(text)], "uint16", 8, 1, 0, 0.0)
    binary = tmp_path / "ids.dat"  # a token file under a name that is not a token file's
    IDS.astype(np.uint16).tofile(binary)
    with pytest.raises(DataError, match=r"NUL bytes, so it is not text: token files end in \.bin .* or \.tok"):
        open_corpus([str(binary)], "uint16", 8, 1, 0, 0.0)


def test_a_directory_stands_for_its_shards_in_name_order(tmp_path):
    paths = shards(tmp_path)
    (tmp_path / "README.txt").write_text("not a shard")
    assert expand([str(tmp_path), "more.txt"]) == paths + ["more.txt"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no token shards"):
        expand([str(tmp_path / "empty")])


def test_a_header_is_read_from_the_first_bytes_alone():
    header = ShardHeader("uint32", 128_256, "x" * 256, 10, 5)
    assert len(header.to_bytes()) < HEAD_BYTES
    assert ShardHeader.parse(header.to_bytes()) == header
