"""The optimizer recipe's pieces against independent references: torch's own
clip_grad_norm_ for clipping from per-stage squared norms, the closed forms of
warm-up and decay, and the bad-input contract of its flags."""
import math

import pytest
import torch

from bamboo.control.config import JobConfig
from bamboo.model import recipe
from tests.training import train_refusal


def test_clipping_from_stage_norms_equals_torch_clip_grad_norm():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 3, dtype=torch.float64)) for n in (4, 7, 2, 5)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    expected = [p.grad.clone() for p in params]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, e in zip(copies, expected):
        c.grad = e.clone()
    torch.nn.utils.clip_grad_norm_(copies, max_norm=1.0)
    stages = [params[:1], params[1:3], params[3:]]  # three stages' parts of one model
    coefficient = recipe.clip_coefficient(1.0, [recipe.squared_norm(s) for s in stages])
    assert coefficient < 1.0
    for stage in stages:
        recipe.scale_grads(stage, coefficient)
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-12, atol=1e-12)


def test_a_small_norm_is_left_alone():
    assert recipe.clip_coefficient(10.0, [1.0, 2.0]) == 1.0


def cfg(**kw):
    return JobConfig.of(iterations=11, lr=1.0, min_lr=0.1, **kw)


def test_warmup_then_cosine_reaches_min_lr_at_the_last_iteration():
    c = cfg(warmup=3, lr_schedule="cosine")
    rates = [recipe.learning_rate(c, i) for i in range(11)]
    assert rates[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert rates[3] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.1)
    assert rates[7] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 4 / 7)))
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))


def test_linear_and_constant_schedules():
    linear = [recipe.learning_rate(cfg(lr_schedule="linear"), i) for i in range(11)]
    assert linear == pytest.approx([1.0 - 0.09 * i for i in range(11)])
    assert {recipe.learning_rate(cfg(warmup=2), i) for i in range(2, 11)} == {1.0}


def test_weight_decay_applies_to_matrices_only():
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = recipe.optimizer(module, JobConfig.of(weight_decay=0.1, betas=(0.8, 0.95)).recipe)
    decay, rest = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])] and decay["weight_decay"] == 0.1
    assert len(rest["params"]) == 3 and rest["weight_decay"] == 0.0 and decay["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("args, message", [
    (["--warmup", "20", "--iterations", "10"], "--warmup 20 must be between 0 and --iterations 10"),
    (["--betas", "0.9", "1.5"], "--betas must be two numbers in [0, 1)"),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr between 0 and --lr"),
    (["--grad-clip", "-1"], "must not be negative"),
    (["--lr-schedule", "step"], "invalid choice"),
])
def test_bad_recipe_flags_are_one_line(tmp_path, args, message, capsys):
    status, err = train_refusal(capsys, *args, "--metrics-out", str(tmp_path / "m.jsonl"))
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.jsonl").exists()
