"""Models as ordered layer lists, so that any contiguous slice is a pipeline stage.

A GPT-style decoder is [Embedding, Block x N, Head]; the last layer maps hidden
states and labels to a scalar loss. Every layer is built under its own seed, so a
node can build just the layers of its stages and still get exactly the weights a
single process would. Dropout draws from a generator seeded per (iteration,
microbatch, layer), so a redundant forward equals the normal one and the math
does not depend on the partition.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bamboo.control.config import Precision


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int
    dim: int
    layers: int
    heads: int
    dropout: float = 0.0


# GPT-2 small's and BERT-large's shapes. The output head is not tied to the token
# embedding (they sit on different stages), so the counts are 124M + 39M = 163M
# and 335M + 31M = 365M parameters; `tiny` has 94K.
MODELS = {
    "tiny": GPTConfig(vocab=256, seq=32, dim=32, layers=6, heads=2, dropout=0.1),
    "gpt2-small": GPTConfig(vocab=50257, seq=1024, dim=768, layers=12, heads=12, dropout=0.1),
    "bert-large": GPTConfig(vocab=30522, seq=512, dim=1024, layers=24, heads=16, dropout=0.1),
}

_context = threading.local()


@contextlib.contextmanager
def dropout_seed(seed: int):
    """Seed for the dropout of every layer run inside: combined with the layer index."""
    previous = getattr(_context, "seed", None)
    _context.seed = seed
    try:
        yield
    finally:
        _context.seed = previous


def seed_rng(seed: int) -> None:
    """torch.manual_seed's effect on the generators training draws from: the CPU's,
    and CUDA's once CUDA is in use. torch.manual_seed itself, while CUDA is not
    initialised (every CPU run), queues the seed for CUDA with a formatted stack
    trace: 0.5 ms a call, paid per layer and microbatch (docs/HOTPATH.md, "One device")."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def layer_rng(layer: int, device: torch.device):
    """Inside: the global RNG (CPU, or the CUDA device) seeded per (dropout seed,
    layer), for layers with plain nn.Dropout; outside a dropout_seed(), unchanged."""
    seed = getattr(_context, "seed", None)
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_rng((seed * 1_000_033 + layer) % (2 ** 63))
        yield


AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
# fp16 is for CUDA. Tests set this to run its loss scaling on the CPU, where torch's
# autocast computes in fp16 too (slowly), since no GPU is at hand there.
FP16_ON_CPU = "BAMBOO_FP16_ON_CPU"


def fp16_allowed(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get(FP16_ON_CPU) == "1"


def mixed_precision(precision: str, device: torch.device):
    """The forward's context: bf16 or fp16 autocast (weights, gradients and AdamW
    state stay float32; fp16 with a dynamic loss scale, on CUDA), or nothing."""
    if precision in AUTOCAST:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST[precision])
    return contextlib.nullcontext()


@contextlib.contextmanager
def evaluating(modules):
    """Inside: every module in eval mode (no dropout); after, each back in the mode
    it had. An evaluation leaves training exactly as it was."""
    modes = [(m, m.training) for m in modules]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.train(was)


class SeededDropout(nn.Module):
    def __init__(self, p: float, layer: int):
        super().__init__()
        self.p, self.layer = p, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        seed = getattr(_context, "seed", None)
        if seed is None:
            raise RuntimeError("dropout outside a dropout_seed() context: results would not be reproducible")
        gen = torch.Generator(device=x.device)
        gen.manual_seed((seed * 1_000_003 + self.layer) % (2 ** 63))
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = SeededDropout(cfg.dropout, layer)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))
        self.drop1, self.drop2 = SeededDropout(cfg.dropout, 2 * layer), SeededDropout(cfg.dropout, 2 * layer + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop1(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Head(nn.Module):
    """Final norm and projection to the vocabulary: logits."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits [batch, seq, vocab] against labels [batch, seq]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def num_layers(cfg: GPTConfig) -> int:
    return cfg.layers + 2


def build_layer(cfg: GPTConfig, index: int, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Layer `index` of the model, initialised from (seed, index) alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 7919 + index)
        if index == 0:
            layer = Embedding(cfg, index)
        elif index == num_layers(cfg) - 1:
            layer = Head(cfg, index)
        else:
            layer = Block(cfg, index)
    return layer.to(dtype)


class Stage(nn.Module):
    """A contiguous slice of the layer list; the last stage ends with the loss.

    `first_layer` seeds the global RNG for any plain nn.Dropout inside, per
    (iteration, microbatch, stage), so a redundant forward repeats the normal one."""

    def __init__(self, layers: list[nn.Module], loss=None, first_layer: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.loss, self.first_layer = loss, first_layer

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        seed = getattr(_context, "seed", None)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                seed_rng((seed * 1_000_033 + self.first_layer) % (2 ** 63))
            for layer in self.layers:
                x = layer(x)
        return self.loss(x, labels) if self.loss is not None else x
