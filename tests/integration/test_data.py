"""Training data: token files (nanoGPT's flat uint16/uint32 arrays) mapped from disk,
the held-out validation tail, the checks against the model's vocabulary, and the
one line bamboo-train prints for data it cannot use (nothing written)."""
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from bamboo.data.corpus import ByteCorpus, DataError, TokenFile, corpora, open_corpus

SEQ, BATCH = 16, 3


def token_file(path, ids, dtype=np.uint16):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.fixture
def marked(tmp_path):
    """900 training ids in 0..99 then 100 held-out ids in 200..255: where a sample
    came from shows in its ids."""
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 100, 900), rng.integers(200, 256, 100)])
    return token_file(tmp_path / "train.bin", ids)


def test_a_token_file_is_mapped_and_sampled_from_seed_iteration_and_index(marked):
    corpus = TokenFile(marked, "uint16", SEQ, BATCH, seed=4, val_fraction=0.1)
    assert isinstance(corpus.tokens, np.memmap) and len(corpus.tokens) == 1000
    x, y = corpus.microbatch(3, 1)
    again = TokenFile(marked, "uint16", SEQ, BATCH, seed=4, val_fraction=0.1).microbatch(3, 1)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1]) and x.shape == (BATCH, SEQ)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(corpus.microbatch(3, 2)[0], x)


def test_training_never_reaches_the_held_out_tail_and_validation_stays_in_it(marked):
    corpus = TokenFile(marked, "uint16", SEQ, BATCH, seed=1, val_fraction=0.1)
    assert corpus.train_end == 900 and corpus.val_tokens == 100
    for it in range(40):
        for g in range(4):
            x, y = corpus.microbatch(it, g)
            assert int(torch.cat([x, y]).max()) < 100
    for g in range(8):
        x, y = corpus.validation(g)
        assert int(torch.cat([x, y]).min()) >= 200
        assert torch.equal(x, corpus.validation(g)[0])  # the same batches at every evaluation
    assert not torch.equal(corpus.validation(0)[0], corpus.validation(1)[0])


def test_without_a_held_out_tail_the_samples_are_unchanged(tmp_path):
    """val_fraction 0 draws exactly what the corpus drew before it had a split."""
    corpus = ByteCorpus(seq=SEQ, batch=BATCH, seed=7)
    rng = np.random.default_rng([7, 4, 2])
    starts = rng.integers(0, len(corpus.tokens) - SEQ - 1, size=BATCH)
    want = np.stack([corpus.tokens[s:s + SEQ] for s in starts]).astype(np.int64)
    assert torch.equal(corpus.microbatch(4, 2)[0], torch.from_numpy(want))


def test_uint32_files_and_the_vocabulary_check(tmp_path):
    path = token_file(tmp_path / "big.bin", [5, 70000, 3] * 20, np.uint32)
    corpus = TokenFile(path, "uint32", 8, 1, 0, 0.0)
    corpus.check_vocabulary(70001, "m")
    with pytest.raises(DataError, match=r"token id 70000 at position 1 is outside model m's vocabulary of 50257"):
        corpus.check_vocabulary(50257, "m")
    with pytest.raises(DataError, match="more than model m's vocabulary of 100"):
        ByteCorpus(seq=8).check_vocabulary(100, "m")


@pytest.mark.parametrize("ids,dtype,seq,fraction,message", [
    (b"\x01\x00\x02", None, 4, 0.0, "3 bytes, not a whole number of uint16 ids"),
    ([1, 2, 3, 4], np.uint16, 4, 0.0, "4 tokens, fewer than one sequence of 5"),
    (list(range(20)), np.uint16, 10, 0.5, "10 tokens, fewer than one sequence of 11 .after holding out 10 "),
    (b"", None, 4, 0.0, "has 0 tokens"),
])
def test_token_files_that_cannot_be_used(tmp_path, ids, dtype, seq, fraction, message):
    path = tmp_path / "t.bin"
    path.write_bytes(ids) if dtype is None else token_file(path, ids, dtype)
    with pytest.raises(DataError, match=message):
        TokenFile(path, "uint16", seq, 1, 0, fraction)


def test_validation_needs_a_sequence_in_the_tail_and_token_files_come_alone(tmp_path, marked):
    corpus = TokenFile(marked, "uint16", SEQ, 1, 0, 0.01)  # 10 held out, fewer than 17
    with pytest.raises(DataError, match="holds out 10 tokens, fewer than one validation sequence of 17"):
        corpus.check_validation()
    text = tmp_path / "a.txt"
    text.write_text("hello " * 100)
    with pytest.raises(DataError, match="must be the only file"):
        open_corpus([str(text), str(marked)], "uint16", SEQ, 1, 0, 0.0)
    with pytest.raises(DataError, match="cannot read token file"):
        TokenFile(tmp_path / "missing.bin")


def test_a_validation_file_of_its_own_leaves_the_training_stream_whole(tmp_path, marked):
    """nanoGPT's train.bin and val.bin: validation draws only from val.bin."""
    val = token_file(tmp_path / "val.bin", np.arange(200, 256).repeat(3))
    train, validation = corpora([str(marked)], [str(val)], "uint16", SEQ, BATCH, 2, 0.0)
    assert train.train_end == 1000 and train.val_tokens == len(validation.tokens) == 168
    for g in range(8):
        assert int(train.validation(g)[0].min()) >= 200
    small = token_file(tmp_path / "small.bin", [1] * 10)
    with pytest.raises(DataError, match="small.bin has 10 tokens, fewer than one sequence of 17"):
        corpora([str(marked)], [str(small)], "uint16", SEQ, BATCH, 2, 0.0)


def bad_token_files(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(2001))
    wide = token_file(tmp_path / "wide.bin", [1, 2, 300] * 400)
    return odd, wide


def cases(tmp_path):
    odd, wide = bad_token_files(tmp_path)
    good = token_file(tmp_path / "good.bin", list(range(256)) * 8)
    return [
        (["--data", str(odd)], "2001 bytes, not a whole number of uint16 ids"),
        (["--data", str(wide)], "token id 300 at position 2 is outside model tiny's vocabulary of 256"),
        (["--data", str(good), "--token-dtype", "uint32"], "outside model tiny's vocabulary"),  # read as uint32
        (["--data", str(good), str(odd)], "must be the only file"),
        (["--data", str(good), "--eval-every", "2", "--val-fraction", "0"], "holds out 0 tokens"),
        (["--val-fraction", "1"], "--val-fraction must be at least 0 and below 1"),
        (["--data", str(good), "--val-data", str(wide)], "token file " + str(wide) + ": token id 300 at position 2"),
        (["--val-data", str(good), "--val-fraction", "0.1"], "not both"),
        (["--eval-every", "-1"], "--eval-every must not be negative"),
        (["--eval-every", "1", "--eval-batches", "0"], "--eval-batches must be at least 1"),
        (["--stages", "2", "--iterations", "4", "--eval-every", "2", "--preempt", "1@0:eval1"],
         "evaluates nothing after iteration 0"),
        (["--stages", "2", "--eval-every", "1", "--eval-batches", "2", "--preempt", "1@0:eval99"],
         "instructions an evaluation"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_data_gives_one_line_and_status_2(tmp_path, capsys, index):
    from commands.train.cli import main
    args, message = cases(tmp_path)[index]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--no-progress", "--iterations", "1", *args, "--metrics-out", str(tmp_path / "m.jsonl")])
    finally:
        signal.signal(signal.SIGTERM, handler)
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "m.jsonl").exists()


def test_a_bad_token_file_from_a_real_process_writes_nothing(tmp_path):
    odd, wide = bad_token_files(tmp_path)
    for path, message in ((odd, "not a whole number of uint16 ids"), (wide, "outside model tiny's vocabulary")):
        out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--stages", "2",
                              "--data", str(path),
                              "--metrics-out", str(tmp_path / "out" / "m.jsonl"), "--save-dir", str(tmp_path / "p")],
                             capture_output=True, text=True, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.bin", "wide.bin"]
