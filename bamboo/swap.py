"""Swapping the intermediates of a redundant forward to host memory and back.

A forward run under `SavedTensors.recording()` keeps the tensors autograd saves
for backward in this container instead of inside the graph. `swap_out` copies them
into host buffers (pinned, on a side stream, when on CUDA) and drops the device
copies; `swap_in` copies them back. Backward then finds them wherever they are.
Parameters are left alone: the node holds them anyway.
"""
from __future__ import annotations

import contextlib

import torch


class SavedTensors:
    def __init__(self, params: set[int]):
        self._params = params  # data_ptrs of parameters, never swapped
        self.tensors: list[torch.Tensor] = []
        self.on_host = False
        self.device: torch.device | None = None

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() in self._params:
            return ("param", t)
        # A detached alias: keeping `t` itself would tie a saved output to its own
        # graph through this container, a cycle the garbage collector cannot see.
        self.tensors.append(t.detach())
        return ("saved", len(self.tensors) - 1)

    def _unpack(self, handle):
        kind, value = handle
        if kind == "param":
            return value
        if self.on_host:
            raise RuntimeError("backward from swapped-out intermediates: swap_in first")
        return self.tensors[value]

    def recording(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def swap_out(self, stream: "torch.cuda.Stream | None" = None) -> None:
        if not self.tensors:
            self.on_host = True
            return
        self.device = self.tensors[0].device
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            pin = self.device.type == "cuda"
            host = []
            for t in self.tensors:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                buf.copy_(t, non_blocking=pin)
                host.append(buf)
        if stream is not None:
            stream.synchronize()
        self.tensors, self.on_host = host, True

    def swap_in(self) -> None:
        if self.device is not None:
            self.tensors = [t.to(self.device, copy=True, non_blocking=self.device.type == "cuda")
                            for t in self.tensors]
        self.on_host = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
