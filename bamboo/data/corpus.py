"""Offline training data: byte-level tokens from text on disk, or pre-tokenised
token files.

By default the corpus is the Python standard library's top-level sources of the
running interpreter, read in sorted order; users can name their own text files;
token shards (`*.tok`, written by bamboo-data with a Hugging Face tokenizer: a
header names their dtype and vocabulary, bamboo/data/shards.py), read as one
stream in the order given; or one raw token file (`FILE.bin`: a flat array of
uint16 or uint32 ids, as nanoGPT's `prepare.py` writes). Every process maps token
files from disk rather than reading them. Any of them may be an object
(s3://BUCKET/KEY, gs://BUCKET/KEY): each machine reads its local copy
(bamboo/data/cache.py), and messages name the object.

The tail of the token stream (`val_fraction` of it) is held out: training never
samples a window that reaches into it, and the validation microbatches are
drawn from it alone; or they are drawn from a validation file of their own
(nanoGPT's `val.bin`), and the training stream is not split. Training
microbatch g of iteration i is drawn from (seed, i, g) alone, validation
microbatch g from (seed, g), so every process, and the
single-process reference, sees the same samples however the global batch is
split across pipelines.
"""
from __future__ import annotations

import os
import pathlib
import sysconfig

import numpy as np
import torch

from bamboo.data.shards import (HEAD_BYTES, MAGIC, SHARD_SUFFIX, TOKEN_DTYPES, Concatenated, ShardError, ShardHeader,
                                is_shard, map_shard)

TOKEN_SUFFIX = ".bin"
BYTE_VOCAB = 256          # what byte-level text needs of a model's vocabulary
_SCAN = 1 << 24           # tokens per chunk when a token file is checked


class DataError(ValueError):
    """The corpus cannot be read, is too small, or does not fit the model."""


def default_files() -> list[pathlib.Path]:
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_token_file(path: str | pathlib.Path) -> bool:
    """A raw token file or a shard (anything else is read as text)."""
    return str(path).endswith(TOKEN_SUFFIX) or is_shard(path)


class Corpus:
    """A token stream: a training head and a held-out validation tail (or, after
    `validate_on`, all of another stream)."""

    def __init__(self, tokens: np.ndarray, seq: int, batch: int, seed: int, val_fraction: float, what: str):
        self.tokens, self.seq, self.batch, self.seed, self.what = tokens, seq, batch, seed, what
        held = int(len(tokens) * val_fraction)
        self.train_end = len(tokens) - held  # training windows end before this token
        if self.train_end < seq + 2:
            raise DataError(f"{what} has {self.train_end} tokens, fewer than one sequence of {seq + 1}"
                            + (f" (after holding out {held} for validation)" if held else ""))
        self.held = (tokens, self.train_end, f"{what}: --val-fraction holds out")  # validation's tokens from an index

    def validate_on(self, other: "Corpus") -> None:
        """Draw validation microbatches from all of `other` (a file of its own)."""
        self.held = (other.tokens, 0, f"{other.what} (--val-data) has")

    @property
    def val_tokens(self) -> int:
        tokens, start, _ = self.held
        return len(tokens) - start

    def check_validation(self) -> None:
        """Validation microbatches need at least one sequence in the held-out tokens."""
        if self.val_tokens < self.seq + 2:
            raise DataError(f"{self.held[2]} {self.val_tokens} tokens, fewer than one validation sequence of "
                            f"{self.seq + 1}")

    def microbatch(self, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [batch, seq] int64: labels are inputs shifted by one."""
        rng = np.random.default_rng([self.seed, iteration, index])
        return self._rows(self.tokens, rng.integers(0, self.train_end - self.seq - 1, size=self.batch))

    def validation(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation microbatch `index`, the same in every evaluation. Its windows
        lie in the held-out tail, so they share no token with a training window."""
        self.check_validation()
        tokens, start, _ = self.held
        rng = np.random.default_rng([self.seed, index])
        return self._rows(tokens, start + rng.integers(0, self.val_tokens - self.seq - 1, size=self.batch))

    def _rows(self, tokens, starts) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([tokens[s:s + self.seq + 1] for s in starts]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def check_vocabulary(self, vocab: int, model: str) -> None:
        """Every id must name a row of the model's embedding."""
        if vocab < BYTE_VOCAB:
            raise DataError(f"{self.what} is byte-level text (ids up to 255), more than model {model}'s "
                            f"vocabulary of {vocab}: give a token file (.bin)")


class ByteCorpus(Corpus):
    def __init__(self, files: list[str | pathlib.Path] | None = None, seq: int = 32, batch: int = 2,
                 seed: int = 0, val_fraction: float = 0.0):
        paths = [pathlib.Path(f) for f in files] if files else default_files()
        chunks = []
        for p in paths:
            try:
                chunks.append(p.read_bytes())
            except OSError as e:
                raise DataError(f"cannot read corpus file {p}: {e.strerror}") from None
            if b"\0" in chunks[-1]:
                raise DataError(f"corpus file {p} holds NUL bytes, so it is not text: token files end in "
                                f"{TOKEN_SUFFIX} (raw ids) or {SHARD_SUFFIX} (bamboo-data shards)")
        super().__init__(np.frombuffer(b"\n".join(chunks), dtype=np.uint8), seq, batch, seed, val_fraction,
                         "corpus")


class TokenFile(Corpus):
    """A flat array of token ids on disk, mapped (never read whole into memory)."""

    def __init__(self, path: str | pathlib.Path, dtype: str = "uint16", seq: int = 32, batch: int = 2,
                 seed: int = 0, val_fraction: float = 0.0, name: str | None = None):
        shown = name or path
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise DataError(f"cannot read token file {shown}: {e.strerror}") from None
        if size % itemsize:
            raise DataError(f"token file {shown} has {size} bytes, not a whole number of {dtype} ids "
                            f"({itemsize} bytes each): is --token-dtype right?")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r") if size else np.zeros(0, TOKEN_DTYPES[dtype])
        super().__init__(tokens, seq, batch, seed, val_fraction, f"token file {shown}")
        self.dtype = dtype

    def check_vocabulary(self, vocab: int, model: str) -> None:
        """Scanned in chunks, so a file of many GB is checked in bounded memory."""
        for start in range(0, len(self.tokens), _SCAN):
            chunk = self.tokens[start:start + _SCAN]
            if int(chunk.max()) >= vocab:
                at = start + int(np.argmax(chunk >= vocab))
                raise DataError(f"{self.what}: token id {int(self.tokens[at])} at position {at} is outside model "
                                f"{model}'s vocabulary of {vocab} (ids 0..{vocab - 1}): is --token-dtype right?")


class TokenShards(Corpus):
    """bamboo-data's shards, read as one stream in the order given. They must come
    from one tokenizer: their headers agree on it, its vocabulary and the dtype."""

    def __init__(self, paths: list, seq: int = 32, batch: int = 2, seed: int = 0, val_fraction: float = 0.0,
                 names: list | None = None):
        names = names or paths
        headers, parts = [], []
        for path, name in zip(paths, names):
            try:
                header, ids = map_shard(str(path))
            except ShardError as e:
                raise DataError(f"token shard {name}: {e}") from None
            headers.append(header)
            parts.append(ids)
        check_one_tokenizer(names, headers)
        super().__init__(parts[0] if len(parts) == 1 else Concatenated(parts), seq, batch, seed, val_fraction,
                         shards_label(names))
        self.names, self.headers, self.parts = names, headers, parts

    def check_vocabulary(self, vocab: int, model: str) -> None:
        """From the headers, each checked against its ids first (scanned in chunks,
        as a raw token file is): a header that understates its largest id is refused."""
        for name, header, ids in zip(self.names, self.headers, self.parts):
            for start in range(0, len(ids), _SCAN):
                if int(ids[start:start + _SCAN].max()) > header.max_id:
                    raise DataError(f"token shard {name}: holds ids above the largest its header names "
                                    f"({header.max_id}): write it again with bamboo-data")
        check_header_vocabulary(self.what, self.headers, vocab, model)


def shards_label(names: list) -> str:
    return f"token shard {names[0]}" if len(names) == 1 else f"token shards {names[0]} .. ({len(names)})"


def check_one_tokenizer(names: list, headers: list[ShardHeader]) -> None:
    first = headers[0]
    for name, h in zip(names, headers):
        if (h.tokenizer, h.vocab, h.dtype) != (first.tokenizer, first.vocab, first.dtype):
            raise DataError(f"token shards {names[0]} and {name} come from different tokenizers ({first.tokenizer}, "
                            f"vocabulary {first.vocab}; {h.tokenizer}, vocabulary {h.vocab}): write them with one")


def check_header_vocabulary(what: str, headers: list[ShardHeader], vocab: int, model: str) -> None:
    """Every id the headers promise is a row of the model's embedding."""
    max_id = max(h.max_id for h in headers)
    if max_id >= vocab:
        raise DataError(f"{what}: ids up to {max_id} (tokenizer {headers[0].tokenizer}) are outside model "
                        f"{model}'s vocabulary of {vocab}: tokenize with the model's own tokenizer")


def check_remote_shards(uris: list[str], vocab: int, model: str) -> None:
    """Shards in a bucket (training and validation together), checked from their
    headers (a ranged read of each), not downloaded: their sizes, one tokenizer,
    every id in the model's vocabulary."""
    if not uris:
        return
    headers = [remote_shard_header(u) for u in uris]
    check_one_tokenizer(uris, headers)
    check_header_vocabulary(shards_label(uris), headers, vocab, model)


def remote_shard_header(uri: str) -> ShardHeader:
    from bamboo.data.cache import stat
    from bamboo.data.objects import bucket_of
    size = stat(uri).size
    bucket, key = bucket_of(uri)
    try:
        if size < len(MAGIC) + 4:
            raise ShardError(f"{size} bytes: not a token shard")
        header = ShardHeader.parse(bucket.get_start(key, min(size, HEAD_BYTES)))
        header.check_size(size)
    except ShardError as e:
        raise DataError(f"token shard {uri}: {e}") from None
    return header


def expand(files) -> list[str]:
    """Each file as given, but a directory (DIR, or an object prefix ending in /:
    s3://BUCKET/PREFIX/) stands for the token shards in it, in name order."""
    from bamboo.data.objects import bucket_of, is_remote, split
    out = []
    for f in map(str, files):
        if is_remote(f) and f.endswith("/"):
            scheme, name, prefix = split(f)
            bucket, _ = bucket_of(f)
            found = [f"{scheme}{name}/{k}" for k in sorted(bucket.list(prefix))
                     if is_shard(k) and "/" not in k[len(prefix):]]  # this folder's, as a directory's
        elif not is_remote(f) and os.path.isdir(f):
            found = sorted(str(p) for p in pathlib.Path(f).iterdir() if is_shard(p) and p.is_file())
        else:
            out.append(f)
            continue
        if not found:
            raise DataError(f"{f} holds no token shards (*{SHARD_SUFFIX})")
        out += found
    return out


def check_files(files) -> None:
    """Text files, one raw token file, or token shards: not mixed."""
    shards = [f for f in files if is_shard(f)]
    raw = [f for f in files if is_token_file(f) and not is_shard(f)]
    if raw and len(files) > 1:
        raise DataError(f"--data: a raw token file ({raw[0]}) must be the only file given")
    if shards and len(shards) < len(files):
        other = next(f for f in files if not is_shard(f))
        raise DataError(f"--data: token shards ({shards[0]}) cannot be mixed with other files ({other})")


def local_paths(files) -> list[str]:
    """Local files as given; objects as this machine's cached copies."""
    from bamboo.data.objects import is_remote
    if not any(is_remote(f) for f in files):
        return list(files)
    from bamboo.data.cache import local_copy
    from bamboo.data.objects import ObjectError
    try:
        return [local_copy(str(f)) if is_remote(f) else f for f in files]
    except ObjectError as e:
        raise DataError(str(e)) from None


def open_corpus(files, token_dtype: str, seq: int, batch: int, seed: int, val_fraction: float) -> Corpus:
    """Text files (byte tokens), token shards, or one raw token file."""
    check_files(files)
    paths = local_paths(files)
    if files and is_shard(files[0]):
        return TokenShards(paths, seq, batch, seed, val_fraction, names=[str(f) for f in files])
    if files and is_token_file(files[0]):
        return TokenFile(paths[0], token_dtype, seq, batch, seed, val_fraction, name=str(files[0]))
    return ByteCorpus(paths, seq, batch, seed, val_fraction)


def corpus_of(cfg, seq: int) -> Corpus:
    """The job's corpus (`cfg` a JobConfig; `seq` the model's sequence length),
    validated on its held-out tail or on cfg.data.val_files."""
    d = cfg.data
    return corpora(d.data_files, d.val_files, d.token_dtype, seq, cfg.schedule.batch, cfg.model.seed, d.val_fraction)[0]


def corpora(files, val_files, token_dtype: str, seq: int, batch: int, seed: int,
            val_fraction: float) -> list[Corpus]:
    """The training corpus, then the validation file's when there is one (the
    training stream is then not split)."""
    train = _named("--data", files, lambda: open_corpus(files, token_dtype, seq, batch, seed,
                                                        0.0 if val_files else val_fraction))
    if not val_files:
        return [train]
    validation = _named("--val-data", val_files, lambda: open_corpus(val_files, token_dtype, seq, batch, seed, 0.0))
    if isinstance(train, TokenShards) and isinstance(validation, TokenShards):
        check_one_tokenizer([train.names[0], validation.names[0]], [train.headers[0], validation.headers[0]])
    train.validate_on(validation)
    return [train, validation]


def _named(flag: str, files, opened):
    """`opened()`, its DataError naming the flag that gave the files (the default
    corpus has none to name)."""
    try:
        return opened()
    except DataError as e:
        if not files or str(e).startswith("--"):
            raise
        raise DataError(f"{flag}: {e}") from None


def split_microbatches(total: int, pipelines: int) -> list[range]:
    """Global microbatch indices of each pipeline: as even as possible, in order."""
    base, extra = divmod(total, pipelines)
    out, start = [], 0
    for j in range(pipelines):
        n = base + (1 if j < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
