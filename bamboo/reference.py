"""The single-process reference: the same model, samples and optimizer with no
pipeline at all. Tests compare every distributed run against it."""
from __future__ import annotations

import torch

from bamboo.config import JobConfig, dropout_seed_for
from bamboo.data import ByteCorpus
from bamboo.models import MODELS, Stage, build_layer, dropout_seed, num_layers


def build_model(cfg: JobConfig) -> Stage:
    mc = MODELS[cfg.model]
    return Stage([build_layer(mc, i, cfg.seed, cfg.torch_dtype) for i in range(num_layers(mc))], last=True)


def train_reference(cfg: JobConfig, on_iteration=None) -> Stage:
    """Run cfg.iterations; on_iteration(i, {global mb: loss}) after each step."""
    torch.set_num_threads(1)
    model = build_model(cfg)
    corpus = ByteCorpus(list(cfg.data_files), seq=MODELS[cfg.model].seq, batch=cfg.batch, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for it in range(cfg.iterations):
        model.zero_grad(set_to_none=True)
        losses = {}
        for g in range(cfg.microbatches):
            x, y = corpus.microbatch(it, g)
            with dropout_seed(dropout_seed_for(cfg.seed, it, g)):
                loss = model(x, y)
            losses[g] = loss.item()
            (loss / cfg.microbatches).backward()
        opt.step()
        if on_iteration:
            on_iteration(it, losses)
    return model
