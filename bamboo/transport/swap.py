"""Swapping the intermediates of a redundant forward to host memory and back.

A forward run under `SavedTensors.recording()` keeps the tensors autograd saves
for backward in this container instead of inside the graph. `swap_out` starts
their copies into pooled host buffers (bamboo/transport/staging.py: on a side stream that
waits for the forward's kernels, pinned, no host synchronisation) and drops the
device copies; `swap_in` starts the copies back, ahead of use (the executor
prefetches the next one); backward's kernels wait for them on the GPU, not the
host. Parameters are left alone: the node holds them anyway, and so is any
tensor that is not on the stage's device: autograd saves host scalars beside
the GPU tensors (the RNG seed and offset of CUDA attention, read by its
backward from host memory), and one moved to the GPU crashes that backward.
A tensor saved by several ops (a layer's input, read by its three projections)
is kept, and copied, once.
"""
from __future__ import annotations

import torch

from bamboo.transport.staging import Copy, Stager


class PoisonReached(RuntimeError):
    """A swapped tensor came back with the NaN its host buffer was filled with."""


class SavedTensors:
    def __init__(self, params: set[int]):
        self._params = params  # data_ptrs of parameters, never swapped
        self.tensors: list[torch.Tensor] = []
        self._index: dict[tuple, int] = {}  # a saved view (where, shape, strides, dtype) -> its place in tensors
        self.host: list[Copy] = []      # while swapped out, per saved tensor: its host copy, or itself if kept
        self.moved: list[bool] = []     # per saved tensor: copied to host (False: kept where it is)
        self.coming: list[Copy] = []    # the copies on their way back, until backward reads them
        self.on_host = False
        self.stager: Stager | None = None

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() in self._params:
            return ("param", t)
        view = (t.data_ptr(), t.device, tuple(t.shape), t.stride(), t.dtype)
        if view not in self._index:
            # A detached alias: keeping `t` itself would tie a saved output to its own
            # graph through this container, a cycle the garbage collector cannot see.
            self._index[view] = len(self.tensors)
            self.tensors.append(t.detach())
        return ("saved", self._index[view])

    def _unpack(self, handle):
        kind, value = handle
        if kind == "param":
            return value
        if self.on_host:
            raise RuntimeError("backward from swapped-out intermediates: swap_in first")
        if self.coming:
            self.tensors = [c.wait_here() for c in self.coming]
            self.coming = []
            swapped = (t for t, moved in zip(self.tensors, self.moved) if moved)
            if self.stager.pool.poison and any(t.is_floating_point() and t.isnan().any() for t in swapped):
                raise PoisonReached("a swapped-in tensor holds its host buffer's poison: BRC read it before "
                                    "the copies landed")
        return self.tensors[value]

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def swap_out(self, stager: Stager | None = None) -> None:
        if self.on_host:
            return
        if self.tensors:
            self.stager = stager or Stager(self.tensors[0].device)
            self.moved = [t.device.type == self.stager.device.type for t in self.tensors]
            self.host = [self.stager.to_host(t) if moved else Copy(t) for t, moved in zip(self.tensors, self.moved)]
        self.tensors, self.on_host, self._index = [], True, {}

    def swap_in(self) -> None:
        """Start the copies back (a no-op when they are back or on their way)."""
        if not self.on_host:
            return
        self.coming = [self.stager.to_device(c.tensor) if moved else c for c, moved in zip(self.host, self.moved)]
        self.host, self.on_host = [], False

    def release(self) -> None:
        """Give the host buffers back: BRC did not need this forward."""
        if self.host:
            self.stager.release([c for c, moved in zip(self.host, self.moved) if moved])
        self.host = []

    def nbytes(self) -> int:
        held = self.tensors or [c.tensor for c in self.host + self.coming]
        return sum(t.numel() * t.element_size() for t in held)
