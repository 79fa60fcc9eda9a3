"""A user's model factory (`--model package.module:function`), built lazily.

No process materialises the whole model. A list of DeepSpeed LayerSpecs stays a
list of specs and layer i is built when asked for. An nn.Sequential or
PipelineModule factory is called on the meta device (shapes, no memory); a layer
asked for is copied off it, given storage and initialised by its own modules'
`reset_parameters()`. The caller seeds each build from (seed, i) alone, so every
layout and the single-process reference start from identical weights.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class FactoryError(ValueError):
    """The factory's model cannot be split into layers or built lazily."""


def layer_items(model) -> tuple[list, object]:
    """(layers or LayerSpecs, loss or None) of an nn.Sequential, a PipelineModule
    or a list, nothing built yet."""
    if isinstance(model, nn.Sequential):
        return list(model), None
    specs = getattr(model, "_layer_specs", None)  # deepspeed.pipe.PipelineModule
    loss = getattr(model, "loss_fn", None) if specs is not None else None
    items = specs if specs is not None else model
    built = getattr(model, "forward_funcs", None)
    if specs is not None and built is not None and len(built) == len(specs):
        items = built  # built on one stage: its modules
    if not isinstance(items, (list, tuple)):
        raise FactoryError(f"a model factory must return an nn.Sequential, a PipelineModule or a list of layers "
                           f"(got {type(model).__name__})")
    for i, item in enumerate(items):
        if not isinstance(item, nn.Module) and not _is_spec(item):
            raise FactoryError(f"layer {i} is a {type(item).__name__}, not an nn.Module or a LayerSpec")
    return list(items), loss


def _is_spec(item) -> bool:
    return hasattr(item, "build") and not isinstance(item, nn.Module)


def _uninitialisable(layer: nn.Module) -> str | None:
    """The first module holding parameters or buffers of its own with no
    reset_parameters() to give them values, by name; None when there is none."""
    for name, module in layer.named_modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and not callable(getattr(module, "reset_parameters", None)):
            return f"{type(layer).__name__}.{name}" if name else type(layer).__name__
    return None


class FactoryModel:
    """Layers of a factory's model, each built on demand."""

    def __init__(self, name: str, factory):
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as e:  # the user's code: whatever it raises, one line naming it
            raise FactoryError(f"--model {name!r}: the factory failed on the meta device, so it cannot be built "
                               f"lazily ({type(e).__name__}: {e})") from None
        self.items, self.loss = layer_items(model)
        for i, item in enumerate(self.items):
            where = _uninitialisable(item) if isinstance(item, nn.Module) else None
            if where is not None:
                raise FactoryError(f"--model {name!r}: layer {i} cannot be built lazily: {where} holds parameters "
                                   "or buffers but has no reset_parameters() to initialise them")
        self.count = len(self.items)

    def build(self, index: int) -> nn.Module:
        """Layer `index`, materialised and initialised under the caller's RNG seed."""
        item = self.items[index]
        if _is_spec(item):
            layer = item.build()
            if not isinstance(layer, nn.Module):
                raise FactoryError(f"layer {index} builds a {type(layer).__name__}, not an nn.Module")
            return layer
        if not any(t.is_meta for t in [*item.parameters(), *item.buffers()]):
            return copy.deepcopy(item)  # a layer without state, or one the factory placed off the meta device
        layer = copy.deepcopy(item).to_empty(device="cpu")
        for module in reversed(list(layer.modules())):  # children first: a parent's own scheme has the last word
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        return layer

    def shape(self, index: int) -> nn.Module:
        """Layer `index` on the meta device (its parameter count, no memory)."""
        item = self.items[index]
        if _is_spec(item):
            with torch.device("meta"):
                return item.build()
        return item
