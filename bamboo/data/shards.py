"""Token shards: the files `bamboo-data` writes, token ids behind a small header
that says how to read them (dtype) and what they fit (the tokenizer, its vocabulary,
the largest id written). The header is the first bytes of the file, so a launch
checks a shard against the model from a ranged read of an object in a bucket,
without downloading the data.

Layout: MAGIC (8 bytes); the header's length (4 bytes, little-endian); the header
(UTF-8 JSON, at most MAX_HEADER bytes); zeros up to a multiple of ALIGN bytes; then
`tokens` ids of `dtype`, little-endian. A shard's file is read as untrusted input:
every header field's type and range is checked, and the file's size must equal the
header's promise.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import os
import tempfile

import numpy as np

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_SUFFIX = ".tok"
MAGIC = b"BAMBOOTK"
ALIGN = 64
MAX_HEADER = 1 << 16
HEAD_BYTES = len(MAGIC) + 4 + MAX_HEADER  # enough of a shard's start to hold any header
MAX_TOKENIZER_NAME = 256


class ShardError(ValueError):
    """A shard that is not one, or whose size or header does not hold together."""


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    dtype: str
    vocab: int       # the tokenizer's vocabulary: every id is below it
    tokenizer: str   # its name or directory, as given to bamboo-data
    tokens: int      # ids after the header
    max_id: int      # the largest id written (-1 when there is none)
    version: int = 1

    def __post_init__(self):
        ints = (self.vocab, self.tokens, self.max_id, self.version)
        if any(type(v) is not int for v in ints) or not all(isinstance(v, str) for v in (self.tokenizer, self.dtype)):
            raise ShardError("header fields of the wrong type")
        if self.version != 1 or self.dtype not in TOKEN_DTYPES:
            raise ShardError(f"version {self.version} with dtype {self.dtype!r} (this reader knows version 1, "
                             f"{' or '.join(TOKEN_DTYPES)})")
        if not 0 < self.vocab <= np.iinfo(TOKEN_DTYPES[self.dtype]).max + 1:
            raise ShardError(f"vocabulary of {self.vocab} does not fit {self.dtype} ids")
        if self.tokens < 0 or not -1 <= self.max_id < self.vocab or len(self.tokenizer) > MAX_TOKENIZER_NAME:
            raise ShardError(f"header out of range: {self.tokens} tokens, largest id {self.max_id} of a "
                             f"vocabulary of {self.vocab}, a tokenizer name of {len(self.tokenizer)} characters")

    @property
    def offset(self) -> int:
        """Where the ids start."""
        return len(self._framed())

    @property
    def itemsize(self) -> int:
        return np.dtype(TOKEN_DTYPES[self.dtype]).itemsize

    def file_size(self) -> int:
        return self.offset + self.tokens * self.itemsize

    def to_bytes(self) -> bytes:
        return self._framed()

    def _framed(self) -> bytes:
        body = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        framed = MAGIC + len(body).to_bytes(4, "little") + body
        return framed + b"\0" * (-len(framed) % ALIGN)

    @classmethod
    def parse(cls, head: bytes) -> "ShardHeader":
        """The header at the start of `head` (a shard's first bytes: HEAD_BYTES is enough)."""
        if head[:len(MAGIC)] != MAGIC:
            raise ShardError("not a token shard (no bamboo-data header)")
        size = int.from_bytes(head[len(MAGIC):len(MAGIC) + 4], "little")
        if size > MAX_HEADER or len(head) < len(MAGIC) + 4 + size:
            raise ShardError(f"header of {size} bytes, cut short or over {MAX_HEADER}")
        try:
            fields = json.loads(head[len(MAGIC) + 4:len(MAGIC) + 4 + size])
        except (UnicodeDecodeError, ValueError, RecursionError):  # nested past the parser's depth: not ours
            raise ShardError("header is not JSON") from None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != names:
            raise ShardError(f"header fields are not {', '.join(sorted(names))}")
        return cls(**fields)

    def check_size(self, size: int) -> None:
        if size != self.file_size():
            raise ShardError(f"{size} bytes where its header promises {self.file_size()} "
                             f"({self.tokens} {self.dtype} ids): cut short or appended to")


def is_shard(path) -> bool:
    return str(path).endswith(SHARD_SUFFIX)


def read_header(path: str) -> ShardHeader:
    """A local shard's header, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            header = ShardHeader.parse(f.read(HEAD_BYTES))
        header.check_size(os.path.getsize(path))
    except OSError as e:
        raise ShardError(f"cannot read it: {e.strerror}") from None
    return header


def map_shard(path: str) -> tuple[ShardHeader, np.ndarray]:
    """The header and the ids, memory-mapped (never read whole)."""
    header = read_header(path)
    if not header.tokens:
        return header, np.zeros(0, TOKEN_DTYPES[header.dtype])
    ids = np.memmap(path, dtype=np.dtype(TOKEN_DTYPES[header.dtype]).newbyteorder("<"), mode="r",
                    offset=header.offset, shape=(header.tokens,))
    return header, ids


def write_shard(path: str, ids: np.ndarray, tokenizer: str, vocab: int) -> ShardHeader:
    """Write `ids` as a shard at `path`: to a temp file, renamed into place."""
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    header = ShardHeader(dtype, vocab, tokenizer, len(ids), int(ids.max()) if len(ids) else -1)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.to_bytes())
            f.write(np.ascontiguousarray(ids, dtype=np.dtype(TOKEN_DTYPES[dtype]).newbyteorder("<")).tobytes())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return header


class Concatenated:
    """Several id arrays read as one stream: a slice may span two of them. Enough
    of an array's interface for a corpus (len, slices)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop, step = where.indices(len(self))
        if step != 1:
            raise IndexError("a concatenated stream is read in runs")
        pieces = []
        while start < stop:
            i = bisect.bisect_right(self.starts, start) - 1
            end = min(stop, self.starts[i + 1])
            pieces.append(self.parts[i][start - self.starts[i]:end - self.starts[i]])
            start = end
        return np.concatenate(pieces) if pieces else self.parts[0][:0]
