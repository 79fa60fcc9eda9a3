"""Model factories for tests, named on the command line as tests.sample_models:NAME."""
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
