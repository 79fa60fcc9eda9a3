"""Offline training data: byte-level tokens from text on disk, or a pre-tokenised
token file.

By default the corpus is the Python standard library's top-level sources of the
running interpreter, read in sorted order; users can name their own text files,
or one token file (`FILE.bin`: a flat array of uint16 or uint32 ids, as nanoGPT's
`prepare.py` writes), which every process maps from disk rather than reading it.
Any of them may be an object (s3://BUCKET/KEY, gs://BUCKET/KEY): each machine
reads its local copy (bamboo/data/cache.py), and messages name the object.

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

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKEN_SUFFIX = ".bin"
BYTE_VOCAB = 256          # what byte-level text needs of a model's vocabulary
_SCAN = 1 << 24           # tokens per chunk when a token file is checked


class DataError(ValueError):
    """The corpus cannot be read, is too small, or does not fit the model."""


def default_files() -> list[pathlib.Path]:
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def is_token_file(path: str | pathlib.Path) -> bool:
    return str(path).endswith(TOKEN_SUFFIX)


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


def check_files(files) -> None:
    """A token file comes alone."""
    tokens = [f for f in files if is_token_file(f)]
    if tokens and len(files) > 1:
        raise DataError(f"--data: a token file ({tokens[0]}) must be the only file given")


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
    """Text files (byte tokens), or one token file."""
    check_files(files)
    paths = local_paths(files)
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
