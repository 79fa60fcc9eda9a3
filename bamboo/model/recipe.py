"""The optimizer recipe: AdamW with decoupled weight decay on matrices only, a
learning rate that warms up and decays, and clipping by the global gradient norm.

The learning rate is a function of the iteration alone, so a checkpoint, a
failover or a redo lands on exactly the rate the uninterrupted run used. The
clipping coefficient needs the norm of the whole model's gradient; stages hold
parts of it and publish their squared norms (bamboo/runtime/executor.py), and every copy
of a stage applies the one coefficient that follows from them. fp16's loss scale
rides on the same norms: a norm that is not finite is an overflow, and every
copy skips that step (protocol.LossScale holds the scale's rule).
"""
from __future__ import annotations

import math

import torch

from bamboo.control.config import LrSchedule


def optimizer(module: torch.nn.Module, recipe) -> torch.optim.AdamW:
    """AdamW over `module`'s parameters: decay for weights of 2 or more dimensions
    (matrices, embeddings), none for biases and norms (nanoGPT's and Megatron's
    choice)."""
    params = list(module.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # fused: one kernel per parameter (on the CPU a third of foreach's time for a small
    # stage, which is on the critical path of every iteration's tail); the reference
    # and the baselines take this recipe too, so every comparison stays exact
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=recipe.lr, betas=tuple(recipe.betas), fused=True)


def learning_rate(cfg, iteration: int) -> float:
    """The rate of `iteration`'s step: a linear warm-up over the recipe's first
    `warmup` iterations, then constant, or a linear or cosine decay to `min_lr` at
    the last."""
    r = cfg.recipe
    if iteration < r.warmup:
        return r.lr * (iteration + 1) / r.warmup
    if r.lr_schedule == LrSchedule.CONSTANT:
        return r.lr
    span = max(1, cfg.schedule.iterations - 1 - r.warmup)
    progress = min(1.0, (iteration - r.warmup) / span)
    if r.lr_schedule == LrSchedule.LINEAR:
        return r.lr - (r.lr - r.min_lr) * progress
    return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(opt: torch.optim.Optimizer, rate: float) -> None:
    for group in opt.param_groups:
        group["lr"] = rate


def scaled_loss(loss: torch.Tensor, microbatches: int, scale: float) -> torch.Tensor:
    """What a microbatch's backward starts from: its share of the global batch's
    mean loss, times fp16's loss scale (a power of two: exact)."""
    share = loss / microbatches
    return share if scale == 1.0 else share * scale


def squared_norm(params) -> float:
    """Sum of squared gradient entries, in float64 (the sum of stages' sums is then
    the same whatever the partition, to rounding). Summed on the gradients' device
    and read once: one host synchronisation per stage on CUDA, not one per tensor."""
    sums = [p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.stack(sums).sum()) if sums else 0.0


def grad_multiplier(recipe, squared_norms, scale: float = 1.0) -> float | None:
    """What every gradient is multiplied by before the step: 1/scale (fp16's loss
    scale undone; a power of two, so exact) times the clipping coefficient of the
    unscaled global norm. None when that norm is not finite: an fp16 overflow
    somewhere, and every copy of every stage skips the step."""
    total = sum(squared_norms)
    if not math.isfinite(total):
        return None
    coefficient = clip_coefficient(recipe.grad_clip, [total / (scale * scale)]) if recipe.grad_clip else 1.0
    return coefficient / scale


def clip_coefficient(max_norm: float, squared_norms) -> float:
    """What every gradient is multiplied by: torch's clip_grad_norm_ rule."""
    norm = math.sqrt(sum(squared_norms))
    return min(1.0, max_norm / (norm + 1e-6))


def scale_grads(params, coefficient: float) -> None:
    if coefficient != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)


def flat_grads(params) -> torch.Tensor:
    """The gradients of `params` (a stage's, or a bucket of them) as one vector (zeros
    where none): one message, to a replica or into an all-reduce."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def set_flat_grads(params, flat: torch.Tensor) -> None:
    """The inverse of flat_grads: a replica takes its owner's gradients."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)  # views: each message is a fresh tensor
        offset += n


def check(args) -> None:
    """Raise ValueError naming the first of bamboo-train's recipe flags that makes no sense."""
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"--lr must be positive and --min-lr between 0 and --lr (got {args.lr} and {args.min_lr})")
    if args.lr_schedule not in LrSchedule.values():
        raise ValueError(f"--lr-schedule must be one of {', '.join(LrSchedule.values())} (got {args.lr_schedule!r})")
    if not 0 <= args.warmup <= args.iterations:
        raise ValueError(f"--warmup {args.warmup} must be between 0 and --iterations {args.iterations}")
    if len(args.betas) != 2 or not all(0 <= b < 1 for b in args.betas):
        raise ValueError(f"--betas must be two numbers in [0, 1) (got {' '.join(map(str, args.betas))})")
    if args.initial_loss_scale <= 0 or args.min_loss_scale <= 0 or args.loss_scale_window < 1:
        raise ValueError(f"--initial-loss-scale and --min-loss-scale must be positive and --loss-scale-window "
                         f"at least 1 (got {args.initial_loss_scale}, {args.min_loss_scale} and "
                         f"{args.loss_scale_window})")
    for flag, value in (("--initial-loss-scale", args.initial_loss_scale), ("--min-loss-scale", args.min_loss_scale)):
        if math.frexp(value)[0] != 0.5:
            raise ValueError(f"{flag} must be a power of two, so that undoing it is exact (got {value})")
    if args.weight_decay < 0 or args.grad_clip < 0:
        raise ValueError(f"--weight-decay and --grad-clip must not be negative "
                         f"(got {args.weight_decay} and {args.grad_clip})")
