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


def _reset(module: nn.Module):
    """The module's own initialiser (torch.nn's attention and transformer modules
    name theirs _reset_parameters), or None."""
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    return None


def _uninitialisable(layer: nn.Module) -> str | None:
    """The first module holding meta parameters or buffers of its own with no
    reset_parameters() to give them values, by name; None when there is none."""
    for name, module in layer.named_modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own) and _reset(module) is None:
            return f"{type(layer).__name__}.{name}" if name else type(layer).__name__
    return None


def _materialise(layer: nn.Module) -> None:
    """Give every meta parameter and buffer storage on the CPU, in place: tensors
    the factory placed off the meta device are kept, a weight shared within the
    layer stays one Parameter."""
    new: dict[int, torch.Tensor] = {}
    for module in layer.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    empty = torch.empty_like(t, device="cpu")
                    new[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[key] = new[id(t)]


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


class FactoryModel:
    """Layers of a factory's model, each built on demand."""

    def __init__(self, name: str, factory, seed: int):
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                torch.manual_seed(seed)  # what the factory puts off the meta device is the same everywhere
                model = factory()
        except Exception as e:  # the user's code: whatever it raises, one line naming it
            raise FactoryError(f"--model {name!r}: the factory failed ({_one_line(e)}) on the meta device, so it "
                               "cannot be built lazily") from None
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
            return self._build_spec(index)
        layer = copy.deepcopy(item)
        if not any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            return layer  # a layer without state, or one the factory placed off the meta device
        _materialise(layer)
        for module in reversed(list(layer.modules())):  # children first: a parent's own scheme has the last word
            if _reset(module) is not None:
                _reset(module)()
        return layer

    def shape(self, index: int) -> nn.Module:
        """Layer `index` on the meta device (its parameter count, no memory)."""
        if _is_spec(self.items[index]):
            with torch.device("meta"):
                return self._build_spec(index)
        return self.items[index]

    def _build_spec(self, index: int) -> nn.Module:
        try:
            layer = self.items[index].build()
        except Exception as e:  # the user's layer class: one line naming it
            raise FactoryError(f"layer {index} ({self.items[index]}) cannot be built ({_one_line(e)})") from None
        if not isinstance(layer, nn.Module):
            raise FactoryError(f"layer {index} builds a {type(layer).__name__}, not an nn.Module")
        return layer
