"""A backward in two passes (bamboo/runtime/two_pass.py) against torch's own whole
backward of the same graph: the input gradient and every weight gradient equal
bit for bit, over several microbatches accumulated, on the project's GPT blocks,
a Hugging Face GPT-2 block, a weight used twice on the input's path, a frozen
weight, and a weight off the input's path."""
import pytest
import torch
import torch.nn as nn

from bamboo.model.builtin import Block, GPTConfig, Head, token_loss
from bamboo.runtime.two_pass import input_pass


class Twice(nn.Module):
    """One Linear applied twice in a row (its weight joins the input's path twice),
    a frozen scale, and a bias added to the output only (off the input's path)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5), requires_grad=False)
        self.out_bias = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(self.lin(torch.relu(self.lin(x)))) * self.scale + self.out_bias


def gpt_stage():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=16, dim=32, layers=2, heads=4, dropout=0.0)
    return nn.Sequential(Block(cfg, 1), Block(cfg, 2)), (2, 16, 32)


def gpt_last_stage():
    torch.manual_seed(1)
    cfg = GPTConfig(vocab=256, seq=16, dim=32, layers=1, heads=4, dropout=0.0)
    return nn.Sequential(Block(cfg, 1), Head(cfg, 2)), (2, 16, 32)


def hf_gpt2_block():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    torch.manual_seed(2)
    block = GPT2Block(GPT2Config(n_embd=32, n_head=4, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0))

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out
    return Stage(), (2, 16, 32)


def twice():
    torch.manual_seed(3)
    return Twice(), (4, 8)


def _whole_and_split(module, shape, last: bool):
    params = [p for p in module.parameters() if p.requires_grad]
    labels = torch.randint(0, 256, shape[:2]) if last else None
    inputs = [torch.randn(shape) for _ in range(3)]
    grads = [torch.randn(module(inputs[0]).shape) if not last else None for _ in range(3)]

    def root(x):
        out = module(x)
        return (token_loss(out, labels) / 3, None) if last else (out, None)

    whole_dx = []
    for x, g in zip(inputs, grads):  # three microbatches accumulated, as a stage does
        x = x.clone().requires_grad_(True)
        out, _ = root(x)
        out.backward(g)
        whole_dx.append(x.grad)
    whole = [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)
    split_dx, owed = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_(True)
        out, _ = root(x)
        dx, o = input_pass(out, g, x, params)
        assert all(p.grad is None for p in params)  # the input pass leaves the weights alone
        split_dx.append(dx)
        owed.append(o)
    for o in owed:  # every weight pass after every input pass: the deepest split
        o.weight_pass()
    return whole_dx, whole, split_dx, [p.grad for p in params]


@pytest.mark.parametrize("make,last", [(gpt_stage, False), (gpt_last_stage, True), (hf_gpt2_block, False),
                                       (twice, False)], ids=["gpt-blocks", "gpt-head-loss", "hf-gpt2", "twice"])
def test_two_passes_give_the_whole_backwards_bits(make, last):
    module, shape = make()
    whole_dx, whole, split_dx, split = _whole_and_split(module, shape, last)
    assert len(whole) > 0 and all(g is not None for g in whole)
    for a, b in zip(whole_dx, split_dx):
        assert torch.equal(a, b)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


def test_a_frozen_weight_gets_no_gradient_and_hooks_fire_as_in_a_whole_backward():
    module, shape = twice()
    fired = []
    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    x = torch.randn(shape).requires_grad_(True)
    out = module(x)
    _, owed = input_pass(out, torch.ones_like(out), x, [p for p in module.parameters() if p.requires_grad])
    assert fired == []
    owed.weight_pass()
    assert sorted(fired) == sorted(id(p) for p in module.parameters() if p.requires_grad)
    assert module.scale.grad is None
