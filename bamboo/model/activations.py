"""What one microbatch's forward keeps for its backward, per layer: the planner's
activation memory (commands/train/plan.py).

Measured, not derived from a formula: each distinct layer is built at full width
(uninitialised: nothing is computed from its values) and run on the CPU on a few
sequences of a few tokens, and the bytes autograd saves are summed (the layer's
own parameters left out). Those bytes are a polynomial in the batch b and the
sequence length s: c + s*beta + b*(s*alpha + s*s*gamma) (beta: tensors of every
position shared by the batch, rotary tables; gamma: attention scores, where an
attention keeps them). Four small runs fix the four numbers, which are then
evaluated at the job's b and s. Attention through SDPA keeps no s*s term on the
CPU nor on a GPU, so gamma is 0 there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bamboo.model.api import ModelError, ModelSource
from bamboo.model.builtin import Stage, dropout_seed

_SEQS = (8, 16, 24)  # at batch 1, then the first at batch 2


@dataclass(frozen=True)
class Bytes:
    """c + s*beta + b*(s*alpha + s*s*gamma): bytes of a microbatch of b sequences of s tokens."""
    constant: float
    per_position: float    # beta
    per_token: float       # alpha
    per_token_pair: float  # gamma

    def at(self, batch: int, seq: int) -> int:
        value = self.constant + seq * self.per_position + batch * seq * (self.per_token + seq * self.per_token_pair)
        return max(0, round(value))


@dataclass(frozen=True)
class LayerBytes:
    """One layer's bytes per microbatch."""
    kept: Bytes       # what autograd keeps from its forward to its backward (distinct storages)
    swapped: Bytes    # what an FRC swap-out copies to host (distinct saved views: bamboo/transport/swap.py)
    owed: Bytes       # a split backward's gradients kept for its weight pass: those of each weighted op's output
    output_per_token: float  # the layer's output: what a stage boundary after it sends

    def saved(self, batch: int, seq: int) -> int:
        return self.kept.at(batch, seq)

    def output(self, batch: int, seq: int) -> int:
        return round(self.output_per_token * batch * seq)


def _fit(points: dict[tuple[int, int], float]) -> Bytes:
    """The four numbers through the four measured points."""
    s1, s2, s3 = _SEQS
    y1, y2, y3 = points[(1, s1)], points[(1, s2)], points[(1, s3)]
    # the batch-1 curve c + s*(alpha+beta) + s*s*gamma through three points
    d1, d2 = (y2 - y1) / (s2 - s1), (y3 - y2) / (s3 - s2)
    gamma = (d2 - d1) / (s3 - s1)
    linear = d1 - gamma * (s1 + s2)
    constant = y1 - linear * s1 - gamma * s1 * s1
    alpha = (points[(2, s1)] - y1) / s1 - gamma * s1
    return Bytes(constant, linear - alpha, alpha, gamma)


def _saved_by(layer: torch.nn.Module, loss, x: torch.Tensor, labels) -> tuple[tuple[int, int, int], torch.Tensor]:
    """Bytes autograd saves running `layer` (and `loss`) on `x`, its parameters left
    out: by distinct storage, and by distinct view (what a swap copies); and the
    outputs of its modules that own weights (the gradients a weight pass starts from)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}
    views: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
            views[(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)] = t.numel() * t.element_size()
        return t

    weighted = [m for m in layer.modules() if any(True for _ in m.parameters(recurse=False))]
    owed = [0]
    hooks = [m.register_forward_hook(lambda _m, _i, o: owed.__setitem__(0, owed[0] + _bytes(o))) for m in weighted]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dropout_seed(0):
            out = Stage([layer], loss)(x, labels)
    finally:
        for h in hooks:
            h.remove()
    return (sum(storages.values()), sum(views.values()), owed[0]), out


def _bytes(output) -> int:
    """A module's output tensors that take a gradient, in bytes (a tuple's, or the one)."""
    tensors = output if isinstance(output, (tuple, list)) else [output]
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.requires_grad)


def _received(x: torch.Tensor) -> torch.Tensor:
    """An output as the next stage receives it: a leaf that takes a gradient."""
    return x.detach().requires_grad_(x.is_floating_point())


def _signature(layer: torch.nn.Module) -> tuple:
    return (type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


def layer_bytes(source: ModelSource, autocast: torch.dtype | None = None) -> list[LayerBytes]:
    """Every layer's `LayerBytes`, under `autocast` (bf16 or fp16) when given. A layer of the same shape
    as one measured before, on the same inputs, is not run again."""
    shapes = [(1, _SEQS[0]), (1, _SEQS[1]), (1, _SEQS[2]), (2, _SEQS[0])]
    tokens = {shape: torch.randint(0, source.vocab, shape) for shape in shapes}
    flowing = dict(tokens)  # what enters the next layer, per measured shape
    known: dict[tuple, tuple[LayerBytes, dict]] = {}
    out = []
    for index in range(source.count):
        with torch.device("meta"):
            layer = source.layer(index)
        last = index == source.count - 1
        key = (_signature(layer), last, tuple((tuple(x.shape), x.dtype) for x in flowing.values()))
        if key not in known:
            known[key] = _measure(layer.to_empty(device="cpu").train(), index, source.loss if last else None,
                                  flowing, tokens, autocast)
        found, flowing = known[key]
        out.append(found)
    return out


def _measure(layer, index: int, loss, flowing: dict, tokens: dict, autocast) -> tuple[LayerBytes, dict]:
    """One layer's bytes, and its outputs at the measured shapes."""
    saved, outputs = {}, {}
    try:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            for shape, x in flowing.items():
                saved[shape], outputs[shape] = _saved_by(layer, loss, x, tokens[shape] if loss else None)
    except Exception as e:  # noqa: BLE001 -- a layer that cannot run here: one line
        raise ModelError(f"layer {index} cannot be measured for the plan ({type(e).__name__}: {e})") from None
    one, two = outputs[(1, _SEQS[0])], outputs[(2, _SEQS[0])]
    per_token = 0.0 if loss else (two.numel() - one.numel()) * one.element_size() / _SEQS[0]
    kept, swapped, owed = (_fit({k: v[i] for k, v in saved.items()}) for i in range(3))
    return LayerBytes(kept, swapped, owed, per_token), {k: _received(v) for k, v in outputs.items()}
