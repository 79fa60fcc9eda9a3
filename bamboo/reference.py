"""The single-process reference: the same model, samples and optimizer with no
pipeline at all. Tests compare every distributed run against it."""
from __future__ import annotations

import torch

from bamboo import recipe
from bamboo.config import JobConfig, dropout_seed_for
from bamboo.data import ByteCorpus
from bamboo.api import ModelSource
from bamboo.models import Stage, dropout_seed, mixed_precision


def train_reference(cfg: JobConfig, on_iteration=None) -> Stage:
    """Run cfg.iterations; on_iteration(i, {global mb: loss}) after each step."""
    torch.set_num_threads(1)
    source = ModelSource(cfg.model, cfg.seed, cfg.torch_dtype, cfg.seq, cfg.model_config)
    layers = [source.layer(i) for i in range(source.count)]
    source.tie(layers)
    model = Stage(layers, source.loss)
    corpus = ByteCorpus(list(cfg.data_files), seq=source.seq, batch=cfg.batch, seed=cfg.seed)
    opt = recipe.optimizer(model, cfg)
    cpu = torch.device("cpu")
    for it in range(cfg.iterations):
        model.zero_grad(set_to_none=True)
        losses = {}
        for g in range(cfg.microbatches):
            x, y = corpus.microbatch(it, g)
            with dropout_seed(dropout_seed_for(cfg.seed, it, g)), mixed_precision(cfg.precision, cpu):
                loss = model(x, y)
            losses[g] = loss.item()
            (loss / cfg.microbatches).backward()
        if cfg.grad_clip:
            params = list(model.parameters())  # a tied weight once
            recipe.scale_grads(params, recipe.clip_coefficient(cfg.grad_clip, [recipe.squared_norm(params)]))
        recipe.set_learning_rate(opt, recipe.learning_rate(cfg, it))
        opt.step()
        if on_iteration:
            on_iteration(it, losses)
    return model
