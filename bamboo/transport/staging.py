"""Copies between a worker's GPU and host memory that never stall its compute.

Two users: the swap of FRC intermediates (bamboo/transport/swap.py) and messages, which
gloo sends from host memory (bamboo/transport/comm.py). On CUDA every copy runs on a side
stream that first waits for the stream that produced the tensor (an event, not
a host synchronisation), into pinned buffers from a pool that reuses them; a
device tensor read on the side stream is recorded on it, so the caching
allocator does not hand its memory out before the copy finished. Whoever needs
the result waits for the copy's event: on the GPU (a stream wait) when kernels
use it, on the host only in a thread of its own (the outbox before gloo sends).
On the CPU the same calls are plain copies (or none), so the code paths run in
CI. `BAMBOO_POISON_HOST=1` fills every buffer the pool hands out with NaN, so
that a copy read before it landed shows (make gpu-check's poison test).
"""
from __future__ import annotations

import os
import threading
from collections import defaultdict

import torch

POISON = "BAMBOO_POISON_HOST"


class HostPool:
    """Host buffers by (shape, dtype), pinned on CUDA, given back once the copy
    that reads or writes them finished (an event), and handed out again. Thread-safe: the
    mailbox and outbox threads take and give too."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.poison = os.environ.get(POISON) == "1"
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._busy: list[tuple[torch.Tensor, object]] = []  # (buffer, the event after which it is free)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever made (the tests count reuse)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            self._collect()
            buf = self._free[key].pop() if self._free[key] else None
            if buf is None:
                self.allocated += 1
        if buf is None:
            buf = torch.empty(key[0], dtype=dtype, pin_memory=self.pinned)
        if self.poison and buf.is_floating_point():
            buf.fill_(float("nan"))
        elif self.poison and buf.dtype == torch.uint8:  # a message's room: NaN in every float type
            buf.fill_(255)
        return buf

    def give(self, buf: torch.Tensor, after=None) -> None:
        """`buf` is free again, or once `after` (an event) has completed."""
        with self._lock:
            if after is None:
                self._free[(tuple(buf.shape), buf.dtype)].append(buf)
            else:
                self._busy.append((buf, after))

    def _collect(self) -> None:
        still = []
        for buf, event in self._busy:
            if event.query():
                self._free[(tuple(buf.shape), buf.dtype)].append(buf)
            else:
                still.append((buf, event))
        self._busy = still


class Copy:
    """A copy under way: its result, and the event after which it is there (None: already)."""

    def __init__(self, tensor: torch.Tensor, event=None, cuda=torch.cuda):
        self.tensor, self.event, self.cuda = tensor, event, cuda
        self.kept = False  # a pooled buffer its sender keeps (gives back itself): the outbox does not

    def wait_here(self) -> torch.Tensor:
        """The result, for kernels on the current stream (they wait; the host does not)."""
        if self.event is not None:
            self.cuda.current_stream(self.tensor.device).wait_event(self.event)
        return self.tensor

    def wait_host(self) -> torch.Tensor:
        """The result, for the host (a thread that may block: the outbox)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


class Stager:
    """One worker's copies between its device and host memory."""

    def __init__(self, device: torch.device, cuda=torch.cuda, streams: bool | None = None):
        """`cuda` and `streams` let the tests run the GPU path on the CPU against a
        recording fake of torch.cuda (tests/unit/transport/test_staging.py)."""
        self.device, self.cuda = device, cuda
        self.on_gpu = device.type == "cuda" if streams is None else streams  # copies on a side stream
        self.pool = HostPool(pinned=device.type == "cuda")
        self.side = cuda.Stream(device) if self.on_gpu else None

    def to_host(self, t: torch.Tensor, copy: bool = True) -> Copy:
        """A host copy of `t` in a pooled buffer, started once the kernels writing `t`
        are done. On the CPU with `copy` False, `t` itself (gloo reads it there)."""
        t = t.detach()
        if not self.on_gpu:
            if not copy:
                return Copy(t.contiguous())
            buf = self.pool.take(t.shape, t.dtype)
            buf.copy_(t)
            return Copy(buf)
        buf = self.pool.take(t.shape, t.dtype)
        self.side.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(self.side):
            buf.copy_(t, non_blocking=True)
            if t.device == self.device:  # (autograd may save a CPU scalar too)
                t.record_stream(self.side)  # its memory stays t's until the copy is done
            event = self.cuda.Event()
            event.record(self.side)
        return Copy(buf, event, self.cuda)

    def to_device(self, host: torch.Tensor, buffer: torch.Tensor | None = None) -> Copy:
        """`host` (a pooled buffer, or a view of the pooled `buffer`) copied to the
        device on the side stream (prefetch: nothing waits for it until
        `Copy.wait_here`); the buffer goes back to the pool once read."""
        buffer = host if buffer is None else buffer
        if not self.on_gpu:
            out = host.clone()
            self.pool.give(buffer)
            return Copy(out)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # the current stream's memory
        self.side.wait_stream(self.cuda.current_stream(self.device))  # out's memory is free to write
        with self.cuda.stream(self.side):
            out.copy_(host, non_blocking=True)  # after any swap-out into `host`: same stream
            out.record_stream(self.side)  # dropped unread, its memory still waits for the copy
            event = self.cuda.Event()
            event.record(self.side)
        self.pool.give(buffer, after=event)
        return Copy(out, event, self.cuda)

    def own_thread(self) -> None:
        """A thread of this worker's (mailbox, outbox) works on its GPU: event
        queries and waits there would otherwise make a context on GPU 0."""
        if self.device.type == "cuda":
            self.cuda.set_device(self.device)

    def release(self, copies: list[Copy]) -> None:
        """Host copies no longer wanted (an FRC that BRC never needed)."""
        for c in copies:
            if c.tensor.device.type == "cpu":
                self.pool.give(c.tensor, after=c.event)
