"""The single-process reference: the same model, samples and optimizer with no
pipeline at all. Tests compare every distributed run against it."""
from __future__ import annotations

import dataclasses

import torch

from bamboo.control.config import JobConfig, dropout_seed_for
from bamboo.control.protocol import LossScale
from bamboo.data.corpus import Corpus, corpus_of
from bamboo.model import recipe
from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage, dropout_seed, evaluating, mixed_precision


def train_reference(cfg: JobConfig, on_iteration=None, on_eval=None, on_scale=None,
                    device: torch.device = torch.device("cpu")) -> Stage:
    """Run cfg.schedule.iterations on `device`; on_iteration(i, {global mb: loss}) after
    each step, preceded, when the iteration is evaluated, by on_eval(i, validation
    loss), and with fp16 by on_scale(i, the LossScale it ran with). A GPU job's
    reference runs on its GPU: dropout masks come from the device's generator,
    and a CUDA generator draws other masks than the CPU's from one seed."""
    torch.set_num_threads(1)
    source = ModelSource.of(cfg.model)
    layers = [source.layer(i).to(device) for i in range(source.count)]
    source.tie(layers)
    model = Stage(layers, source.loss)
    corpus = corpus_of(cfg, source.seq)
    opt = recipe.optimizer(model, cfg.recipe)
    scale = LossScale(cfg.recipe.initial_loss_scale if cfg.recipe.loss_scaling else 1.0)
    for it in range(cfg.schedule.iterations):
        model.zero_grad(set_to_none=True)
        kept = []
        for g in range(cfg.schedule.microbatches):
            x, y = (to_device(t, device) for t in corpus.microbatch(it, g))
            with dropout_seed(dropout_seed_for(cfg.model.seed, it, g)), mixed_precision(cfg.recipe.precision, device):
                loss = model(x, y)
            kept.append(loss.detach())
            recipe.scaled_loss(loss, cfg.schedule.microbatches, scale.scale).backward()
        params = list(model.parameters())  # a tied weight once
        if cfg.recipe.grad_clip or cfg.recipe.loss_scaling:
            multiplier = recipe.grad_multiplier(cfg.recipe, [recipe.squared_norm(params)], scale.scale)
            scale = dataclasses.replace(scale, overflow=multiplier is None)
            if multiplier is not None:
                recipe.scale_grads(params, multiplier)
        if not scale.overflow:
            recipe.set_learning_rate(opt, recipe.learning_rate(cfg, it))
            opt.step()
        losses = dict(enumerate(torch.stack(kept).tolist()))  # read once: one host synchronisation an iteration
        if cfg.recipe.loss_scaling:
            if on_scale:
                on_scale(it, scale)
            scale = scale.following(cfg.recipe.loss_scale_window, cfg.recipe.min_loss_scale)
        if on_eval and cfg.evaluates(it):
            on_eval(it, validation_loss(model, corpus, cfg))
        if on_iteration:
            on_iteration(it, losses)
    return model


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A microbatch's tensor on `device`. To a GPU from pinned memory, without
    waiting: a copy from pageable memory first waits for every kernel queued."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def validation_loss(model: Stage, corpus: Corpus, cfg: JobConfig) -> float:
    """The mean loss of the cfg.data.eval_batches validation microbatches: eval mode (no
    dropout), no gradients, the training precision, on the model's device; the model
    is left as it was."""
    device = next(model.parameters()).device
    with torch.no_grad(), evaluating([model]), mixed_precision(cfg.recipe.precision, device):
        losses = [model(*(t.to(device) for t in corpus.validation(g))).item() for g in range(cfg.data.eval_batches)]
    return mean_loss(dict(enumerate(losses)), cfg.data.eval_batches)


def mean_loss(losses: dict[int, float], count: int) -> float:
    """The mean of microbatches 0..count-1's losses, summed in index order (the
    launcher's and the reference's mean are one computation)."""
    return sum(losses[g] for g in range(count)) / count
