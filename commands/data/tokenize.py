"""`bamboo-data --tokenizer NAME|DIR --out DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX FILE ...`:
text files (each one document) or JSON lines (each line's --text-field one
document) tokenized with a Hugging Face tokenizer into token shards
(bamboo/data/shards.py) of --shard-tokens ids each, named NAME-00000.tok,
NAME-00001.tok, ... in --out: a directory, or a bucket's prefix they are uploaded
to (all of them or, when an upload fails, none).

Each document is encoded as the tokenizer encodes a text by default (Llama's adds
its BOS, GPT-2's nothing) and ends with the tokenizer's EOS when it has one, so
documents stay apart in the stream. A shard's header records the tokenizer, its
vocabulary and the largest id written: bamboo-train and bamboo-launch check them
against the model from the header alone. Shards are written to a temp file and
renamed; shards of the same name already in --out are never overwritten.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from typing import Iterator

import numpy as np

from bamboo.control.parser import OneLineParser
from bamboo.data.objects import ObjectError, bucket_of, is_remote
from bamboo.data.shards import MAX_TOKENIZER_NAME, SHARD_SUFFIX, write_shard

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
BATCH_DOCUMENTS = 256  # documents handed to the tokenizer at once (its fast batch path)


class DataInputError(ValueError):
    """An input, the tokenizer or --out that cannot be used; the message says which."""


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="bamboo-data", description="Text to token shards for bamboo-train --data, with a "
                       "Hugging Face tokenizer (a name on the Hub, or a directory saved with save_pretrained).")
    ap.add_argument("inputs", nargs="+", metavar="FILE",
                    help="text files (each one document) or .jsonl files (each line one document)")
    ap.add_argument("--tokenizer", required=True, metavar="NAME|DIR",
                    help="the model's tokenizer: a Hub name (fetched by transformers, on this machine) or a "
                         "local directory")
    ap.add_argument("--out", required=True, metavar="DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX",
                    help="where the shards go: a directory (made if absent), or a bucket's prefix")
    ap.add_argument("--name", default="train", help="the shards' name: NAME-00000.tok, ...")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                    help="ids per shard (200 MB of uint16 by default); the last holds the rest")
    ap.add_argument("--text-field", default="text", metavar="KEY",
                    help="the field of each JSON line that holds its text")
    return ap


def check_args(args) -> None:
    if args.shard_tokens < 1:
        raise DataInputError(f"--shard-tokens must be at least 1 (got {args.shard_tokens})")
    if not args.tokenizer.strip() or len(args.tokenizer) > MAX_TOKENIZER_NAME:
        raise DataInputError(f"--tokenizer must be a name or path of 1 to {MAX_TOKENIZER_NAME} characters "
                             f"(its shards' headers record it)")
    if not NAME.fullmatch(args.name):
        raise DataInputError(f"--name {args.name!r}: letters, digits, '.', '_' and '-' only, at most 64")
    for path in args.inputs:
        if not os.path.isfile(path):
            raise DataInputError(f"{path}: no such file")
    if is_remote(args.out):
        taken = sorted(k.rpartition("/")[2] for k in _remote_listing(args.out, args.name))
    else:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise DataInputError(f"--out {args.out}: exists and is not a directory")
        taken = os.listdir(args.out) if os.path.isdir(args.out) else []
    taken = sorted(f for f in taken if f.startswith(f"{args.name}-") and f.endswith(SHARD_SUFFIX))
    if taken:
        raise DataInputError(f"--out {args.out} already holds shards named {args.name} ({taken[0]}): give another "
                             f"--name or --out, or remove them")


def load_tokenizer(name: str):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no warning per over-long document
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataInputError(f"--tokenizer {name}: cannot load it: {first}") from None


def documents(paths: list[str], field: str) -> Iterator[str]:
    """Each text file whole; each line of a .jsonl file's `field`."""
    for path in paths:
        try:
            if not path.endswith(".jsonl"):
                with open(path, encoding="utf-8") as f:
                    yield f.read()
                continue
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield _text_of(line, field, f"{path}:{number}")
        except UnicodeDecodeError as e:
            raise DataInputError(f"{path}: not UTF-8 text (byte {e.start} of a read)") from None
        except OSError as e:
            raise DataInputError(f"{path}: cannot read it: {e.strerror}") from None


def _text_of(line: str, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError:
        raise DataInputError(f"{where}: not JSON") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DataInputError(f"{where}: not a JSON object with a string {field!r} field (--text-field)")
    return record[field]


def token_runs(docs: Iterator[str], tokenizer) -> Iterator[list[int]]:
    """Each document's ids, ended with the EOS when the tokenizer has one."""
    eos, batch = tokenizer.eos_token_id, []
    for doc in docs:
        batch.append(doc)
        if len(batch) == BATCH_DOCUMENTS:
            yield from _encoded(batch, tokenizer, eos)
            batch = []
    yield from _encoded(batch, tokenizer, eos)


def _encoded(batch: list[str], tokenizer, eos) -> Iterator[list[int]]:
    if not batch:
        return
    for ids in tokenizer(batch)["input_ids"]:
        yield list(ids) + ([eos] if eos is not None and (not ids or ids[-1] != eos) else [])


def shards(runs: Iterator[list[int]], size: int) -> Iterator[np.ndarray]:
    """The stream of ids cut into arrays of `size` (the last may be shorter); a long
    document is joined once and cut in place, not copied for every cut."""
    pending, count = [], 0
    for ids in runs:
        pending.append(np.asarray(ids, dtype=np.int64))
        count += len(ids)
        if count >= size:
            flat, start = np.concatenate(pending), 0
            while count - start >= size:
                yield flat[start:start + size]
                start += size
            pending, count = [flat[start:]], count - start
    if count:
        yield np.concatenate(pending)


def tokenize(args, staging: bool = False) -> list[str]:
    """Write the shards; their paths. On any failure, those written are removed:
    --out holds all of the inputs' shards or none (a rerun is then not refused).
    `staging`: --out is upload's temporary directory, the arguments checked."""
    if not staging:
        check_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise DataInputError(f"--out {args.out}: cannot make it ({e.strerror})") from None
    written, total = [], 0
    try:
        for ids in shards(token_runs(documents(args.inputs, args.text_field), tokenizer), args.shard_tokens):
            path = os.path.join(args.out, f"{args.name}-{len(written):05d}{SHARD_SUFFIX}")
            header = write_shard(path, ids, args.tokenizer, len(tokenizer))
            written.append(path)
            total += header.tokens
    except BaseException as e:
        for path in written:
            os.unlink(path)
        if isinstance(e, OSError):
            raise DataInputError(f"--out {args.out}: cannot write a shard ({e.strerror or e})") from None
        raise
    if not written:
        raise DataInputError("the inputs hold no text")
    where = f"{written[0]} .. {written[-1]}" if not staging else f"{args.name}-*{SHARD_SUFFIX}"
    print(f"bamboo-data: {total} tokens in {len(written)} shard(s) {where} (tokenizer "
          f"{args.tokenizer}, vocabulary {len(tokenizer)}, {header.dtype})")
    return written


def _remote_listing(uri: str, name: str) -> list[str]:
    """The keys under `uri`'s prefix (as a folder) that start with `name`-."""
    try:
        bucket, prefix = bucket_of(uri)
        return bucket.list(f"{prefix.strip('/')}/{name}-".lstrip("/"))
    except ObjectError as e:
        raise DataInputError(f"--out {uri}: {str(e).splitlines()[0]}") from None


def upload(args) -> list[str]:
    """Tokenize into a temporary directory, then upload every shard to --out; when
    an upload fails (or is interrupted), the shards uploaded are removed."""
    check_args(args)
    uri = args.out.rstrip("/")
    bucket, prefix = bucket_of(uri)  # checked by check_args's listing
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bamboo-data-") as local:
        staged = tokenize(argparse.Namespace(**{**vars(args), "out": local}), staging=True)
        try:
            for path in staged:
                key = f"{prefix.strip('/')}/{os.path.basename(path)}".lstrip("/")
                with open(path, "rb") as f:
                    bucket.put(key, f.read())
                done.append(key)
        except BaseException as e:
            _remove(bucket, done)
            if isinstance(e, ObjectError):
                raise DataInputError(f"--out {uri}: {str(e).splitlines()[0]}") from None
            raise
    print(f"bamboo-data: uploaded {len(done)} shard(s) to {uri}/")
    return [f"{uri}/{k.rpartition('/')[2]}" for k in done]


def _remove(bucket, keys: list[str]) -> None:
    """Delete what an upload sent, as far as the store lets us (its error is the one to report)."""
    for key in keys:
        try:
            bucket.delete(key)
        except ObjectError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        upload(args) if is_remote(args.out) else tokenize(args)
    except DataInputError as e:
        print(f"bamboo-data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
