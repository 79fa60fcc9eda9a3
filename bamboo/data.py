"""Offline training data: byte-level tokens from text on disk.

By default the corpus is the Python standard library's top-level sources of the
running interpreter, read in sorted order; users can name their own files.
Microbatch g of iteration i is drawn from (seed, i, g) alone, so every process,
and the single-process reference, sees the same samples however the global batch
is split across pipelines.
"""
from __future__ import annotations

import pathlib
import sysconfig

import numpy as np
import torch


class DataError(ValueError):
    """The corpus cannot be read or is too small."""


def default_files() -> list[pathlib.Path]:
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


class ByteCorpus:
    def __init__(self, files: list[str | pathlib.Path] | None = None, seq: int = 32, batch: int = 2,
                 seed: int = 0):
        paths = [pathlib.Path(f) for f in files] if files else default_files()
        chunks = []
        for p in paths:
            try:
                chunks.append(p.read_bytes())
            except OSError as e:
                raise DataError(f"cannot read corpus file {p}: {e.strerror}") from None
        self.tokens = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
        if len(self.tokens) < seq + 2:
            raise DataError(f"corpus has {len(self.tokens)} bytes, fewer than one sequence of {seq + 1}")
        self.seq, self.batch, self.seed = seq, batch, seed

    def microbatch(self, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [batch, seq] int64: labels are inputs shifted by one."""
        rng = np.random.default_rng([self.seed, iteration, index])
        starts = rng.integers(0, len(self.tokens) - self.seq - 1, size=self.batch)
        rows = np.stack([self.tokens[s:s + self.seq + 1] for s in starts]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def split_microbatches(total: int, pipelines: int) -> list[range]:
    """Global microbatch indices of each pipeline: as even as possible, in order."""
    base, extra = divmod(total, pipelines)
    out, start = [], 0
    for j in range(pipelines):
        n = base + (1 if j < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out
