"""bamboo-data: text and JSON lines to shards, compared with the Hugging Face
tokenizer itself encoding each document; bad input is one line and status 2."""
import json

import pytest

from bamboo.data.corpus import open_corpus
from bamboo.data.shards import read_header
from commands.data.tokenize import main
from tests.sample_tokenizer import save_tokenizer

DOCS = ["def f(x):\n    return x + 1\n", "", "import os\nprint(os.sep)\n" * 40, "ünïcode text, κόσμε\n"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    directory = save_tokenizer(tmp_path_factory.mktemp("tok"))
    return directory, AutoTokenizer.from_pretrained(directory)


def expected(tok, docs) -> list[int]:
    """Each document as the tokenizer encodes it (BOS first), then its EOS."""
    return [i for d in docs for i in tok(d)["input_ids"] + [tok.eos_token_id]]


def test_text_and_json_lines_become_shards_of_the_tokenizer_s_ids(tmp_path, tokenizer, capsys):
    directory, tok = tokenizer
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": d, "id": n}) for n, d in enumerate(DOCS[1:]))
                                      + "\n\n")
    out = tmp_path / "shards"
    assert main(["--tokenizer", directory, "--out", str(out), "--shard-tokens", "50",
                 str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == 0
    want = expected(tok, DOCS)
    paths = sorted(str(p) for p in out.glob("train-*.tok"))
    assert len(paths) == -(-len(want) // 50)
    assert f"{len(want)} tokens in {len(paths)} shard(s)" in capsys.readouterr().out
    headers = [read_header(p) for p in paths]
    assert [h.tokens for h in headers] == [50] * (len(paths) - 1) + [len(want) - 50 * (len(paths) - 1)]
    assert {(h.tokenizer, h.vocab, h.dtype) for h in headers} == {(directory, len(tok), "uint16")}
    corpus = open_corpus(paths, "uint16", 8, 1, 0, 0.0)
    assert corpus.tokens[0:len(corpus.tokens)].tolist() == want
    assert max(h.max_id for h in headers) == max(want)
    assert tok.decode(want, skip_special_tokens=True) == "".join(DOCS)


def test_existing_shards_of_the_name_are_never_overwritten(tmp_path, tokenizer, capsys):
    (tmp_path / "a.txt").write_text(DOCS[2])
    args = ["--tokenizer", tokenizer[0], "--out", str(tmp_path / "o"), str(tmp_path / "a.txt")]
    assert main(args) == 0
    before = (tmp_path / "o" / "train-00000.tok").read_bytes()
    capsys.readouterr()
    assert main(args) == 2
    assert "already holds shards named train (train-00000.tok)" in capsys.readouterr().err
    assert (tmp_path / "o" / "train-00000.tok").read_bytes() == before
    assert main(args + ["--name", "val"]) == 0 and (tmp_path / "o" / "val-00000.tok").exists()


def test_a_failure_half_way_leaves_no_shard(tmp_path, tokenizer, capsys):
    """Shards written before a bad input are removed: a rerun is not refused."""
    (tmp_path / "a.txt").write_text(DOCS[2])
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\nnot json\n')
    args = ["--tokenizer", tokenizer[0], "--out", str(tmp_path / "o"), "--shard-tokens", "20"]
    assert main(args + [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == 2
    assert "b.jsonl:2: not JSON" in capsys.readouterr().err and list((tmp_path / "o").iterdir()) == []
    assert main(args + [str(tmp_path / "a.txt")]) == 0 and len(list((tmp_path / "o").iterdir())) > 1


def bad_inputs(tmp_path, tokenizer):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "bad.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "file").write_text("x")
    ok = str(tmp_path / "ok.txt")
    return [
        (["--shard-tokens", "0", ok], "--shard-tokens must be at least 1"),
        (["--name", "../up", ok], "--name '../up'"),
        ([str(tmp_path / "missing.txt")], "missing.txt: no such file"),
        ([str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON object with a string 'text' field"),
        ([str(tmp_path / "latin1.txt")], "latin1.txt: not UTF-8 text"),
        (["--out", str(tmp_path / "file"), ok], "exists and is not a directory"),
        (["--tokenizer", str(tmp_path / "no-tokenizer-here"), ok], "cannot load it"),
    ]


@pytest.mark.parametrize("index", range(7))
def test_bad_input_is_one_line_and_status_2(tmp_path, tokenizer, capsys, index):
    extra, why = bad_inputs(tmp_path, tokenizer)[index]
    args = ["--tokenizer", tokenizer[0], "--out", str(tmp_path / "o")] + extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bamboo-data: error: ") and why in err[0], err
    assert not list((tmp_path / "o").glob("*")) if (tmp_path / "o").is_dir() else True

