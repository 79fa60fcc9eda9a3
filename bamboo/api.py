"""Where a job's layers come from.

`--model` names a built-in transformer (`tiny`, `gpt2-small`, `bert-large`), a
Hugging Face causal LM (`hf:NAME`, or any GPT-2/Llama config given as JSON text:
bamboo/hf.py), or a factory `package.module:function` returning any of: an nn.Sequential, a DeepSpeed
PipelineModule (its layer specs and loss are used), or a list of modules or
DeepSpeed LayerSpecs. Built-in layers are initialised from (seed, index) alone, so
a node builds only its own; a factory is called once per process under the job's
seed. A factory model takes byte tokens [batch, seq] and returns logits; its loss
is the PipelineModule's, else next-token cross-entropy.
"""
from __future__ import annotations

import copy
import importlib
import sys

import torch
import torch.nn as nn

from bamboo.data import BYTE_VOCAB
from bamboo.models import MODELS, build_layer, num_layers, token_loss


class ModelError(ValueError):
    """The --model cannot be built."""


def layers_from(model) -> tuple[list[nn.Module], object]:
    """(layers, loss or None) from an nn.Sequential, a PipelineModule or a list."""
    if isinstance(model, nn.Sequential):
        return list(model), None
    specs = getattr(model, "_layer_specs", None)  # deepspeed.pipe.PipelineModule
    loss = getattr(model, "loss_fn", None) if specs is not None else None
    items = specs if specs is not None else model
    built = getattr(model, "forward_funcs", None)
    if specs is not None and built is not None and len(built) == len(specs):
        items = built  # built on one stage: keep its weights
    if not isinstance(items, (list, tuple)):
        raise ModelError(f"a model factory must return an nn.Sequential, a PipelineModule or a list of layers "
                         f"(got {type(model).__name__})")
    layers = []
    for item in items:
        built = item.build() if hasattr(item, "build") and not isinstance(item, nn.Module) else item
        if not isinstance(built, nn.Module):
            raise ModelError(f"layer {len(layers)} is a {type(built).__name__}, not an nn.Module")
        layers.append(built)
    return layers, loss


class ModelSource:
    def __init__(self, name: str, seed: int, dtype: torch.dtype = torch.float32, seq: int = 32,
                 config_json: str | None = None):
        self.name, self.seed, self.dtype = name, seed, dtype
        self.hf = None      # a Hugging Face family model (bamboo/hf.py)
        self.ties: list[tuple[int, str, int, str]] = []  # (layer, parameter) pairs that are one weight
        if name.startswith("hf:") or config_json is not None:
            self._init_hf(name, seq, config_json)
            return
        if name in MODELS:
            self.config = MODELS[name]
            self.count, self.seq, self.loss = num_layers(self.config), self.config.seq, token_loss
            self._layers = None
            return
        if ":" not in name:
            raise ModelError(f"--model {name!r} is neither a built-in ({', '.join(sorted(MODELS))}) "
                             "nor a factory package.module:function")
        module_name, _, fn_name = name.partition(":")
        if "" not in sys.path:
            sys.path.insert(0, "")  # factories in the working directory
        try:
            factory = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise ModelError(f"--model {name!r}: cannot load it ({e})") from None
        if not callable(factory):
            raise ModelError(f"--model {name!r} is a {type(factory).__name__}, not a function returning a model")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = factory()
            except Exception as e:  # the user's code: whatever it raises, one line naming it
                raise ModelError(f"--model {name!r}: the factory failed ({type(e).__name__}: {e})") from None
            layers, loss = layers_from(model)
        self._layers = [layer.to(dtype) for layer in layers]
        self.count, self.seq, self.loss = len(self._layers), seq, loss or token_loss

    def _init_hf(self, name: str, seq: int, config_json: str | None) -> None:
        from bamboo.hf import HFConfigError, HFModel, causal_lm_loss, load_config

        where = "--model-config" if config_json is not None else f"--model {name}"
        try:
            self.hf = HFModel(load_config(name.removeprefix("hf:"), config_json))
            with torch.device("meta"):  # a config transformers accepts but cannot build fails here, not in a worker
                for index in {0, 1, self.hf.count - 2, self.hf.count - 1}:
                    self.hf.build(index)
        except HFConfigError as e:
            raise ModelError(str(e)) from None
        except Exception as e:  # noqa: BLE001 -- transformers' own checks raise several types
            raise ModelError(f"{where}: cannot build it ({type(e).__name__}: {e})") from None
        if seq > self.hf.max_seq:
            raise ModelError(f"--seq {seq} is longer than the model's {self.hf.max_seq} positions")
        self.config, self._layers = self.hf.config, None
        self.count, self.seq, self.loss, self.ties = self.hf.count, seq, causal_lm_loss, self.hf.ties()

    @property
    def vocab(self) -> int:
        """How many token ids the model embeds: a built-in's or a Hugging Face
        config's; a factory model takes byte tokens (256)."""
        if self.hf is not None:
            return self.config.vocab_size
        if self._layers is None:
            return self.config.vocab
        return BYTE_VOCAB

    def _build(self, index: int) -> nn.Module:
        if self.hf is None:
            return build_layer(self.config, index, self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 7919 + index)
            return self.hf.build(index)

    def layer(self, index: int) -> nn.Module:
        """Layer `index` with its first values: a new module each call (a factory's
        are copies, so training one never changes what a rebuild gets). A tied
        weight starts, in every copy, as the first layer of its pair built it."""
        if self._layers is not None:
            return copy.deepcopy(self._layers[index])
        layer = self._build(index)
        for first, first_name, second, second_name in self.ties:
            if index == second:
                with torch.no_grad():
                    layer.get_parameter(second_name).copy_(self._build(first).get_parameter(first_name))
        return layer.to(self.dtype)

    def costs(self) -> list[float]:
        """Parameter count per layer (built-in and HF layers are counted on the meta device)."""
        if self._layers is None:
            with torch.device("meta"):
                layers = [self._build(i) for i in range(self.count)]
        else:
            layers = self._layers
        return [float(sum(p.numel() for p in layer.parameters())) or 1.0 for layer in layers]

    def tie(self, layers: list[nn.Module]) -> None:
        """Make each tied pair one parameter, in a list of every layer (the
        single-process reference: one weight, one gradient)."""
        for first, first_name, second, second_name in self.ties:
            owner, _, attr = second_name.rpartition(".")
            setattr(layers[second].get_submodule(owner), attr, layers[first].get_parameter(first_name))
