"""The environment a worker process starts with.

glibc's malloc, left to itself, serves each allocation over its (moving) mmap
threshold with a fresh mapping and hands freed heap tops back to the kernel, so a
training step that allocates and frees the same activation-sized blocks every
microbatch pays page faults for them again and again; a worker's message threads,
allocating in arenas of their own, add more. Fixing both thresholds keeps those
blocks in the heap for reuse (about half the page faults of a CPU pipeline gone,
its compute per iteration on par with DeepSpeed's again: docs/HOTPATH.md). 32 MiB
is the largest mmap threshold glibc accepts everywhere (larger is ignored where
the heap's maximum is 64 MiB, and the trim setting alone would pin the threshold
at 128 KiB). Settings the user gave win; `scripts/bench_hotpath.py` gives the
baselines the same.
"""
from __future__ import annotations

import os

MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),   # blocks under 32 MiB come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),  # a free heap top under 256 MiB is kept for reuse
}


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a worker (or the agent that starts one): the
    malloc settings above unless already set, then `extra`."""
    return {**MALLOC, **os.environ, **extra}
