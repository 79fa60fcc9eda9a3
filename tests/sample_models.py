"""Model factories for tests, named on the command line as tests.sample_models:NAME."""
import os
import sys

import torch
import torch.nn as nn


class Tokens(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.emb = nn.Embedding(256, dim)

    def forward(self, tokens):
        return self.emb(tokens)


def byte_mlp() -> nn.Sequential:
    return nn.Sequential(Tokens(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 256))


def layer_specs():
    from deepspeed.pipe import LayerSpec
    return [LayerSpec(Tokens, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 8, 256)]


def not_a_model():
    return 42


class Recorded(nn.Linear):
    """A Linear that appends "<worker argv> <tag>" to $BAMBOO_RECORD each time it is
    materialised (its reset_parameters runs on real storage, never on meta)."""

    def __init__(self, dim: int, tag: int):
        self.tag = tag
        super().__init__(dim, dim)

    def reset_parameters(self):
        super().reset_parameters()
        if not self.weight.is_meta and os.environ.get("BAMBOO_RECORD"):
            with open(os.environ["BAMBOO_RECORD"], "a") as f:
                f.write(f"{' '.join(sys.argv)}\t{self.tag}\n")


def recorded_mlp() -> nn.Sequential:
    """Eight layers, six of them recording where they are materialised."""
    return nn.Sequential(Tokens(16), *[Recorded(16, i) for i in range(1, 7)], nn.Linear(16, 256))


class Unresettable(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.scale


def unresettable():
    return nn.Sequential(Tokens(16), Unresettable(), nn.Linear(16, 256))


def meta_hostile():
    return nn.Sequential(Tokens(int(torch.ones(1).sum().item())), nn.Linear(1, 256))


class SharedPair(nn.Module):
    """Two Linears sharing one weight, and a buffer the factory places on the CPU."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.full((16,), 0.5, device="cpu"))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


def shared_and_attention():
    return nn.Sequential(Tokens(16), SharedPair(),
                         nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Linear(16, 256))
