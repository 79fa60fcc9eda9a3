"""Where a job's layers come from.

`--model` names a built-in transformer (`tiny`, `gpt2-small`, `bert-large`), a
Hugging Face causal LM (`hf:NAME`, or any GPT-2/Llama config given as JSON text:
bamboo/model/hf.py), or a factory `package.module:function` returning any of: an nn.Sequential, a DeepSpeed
PipelineModule (its layer specs and loss are used), or a list of modules or
DeepSpeed LayerSpecs. Every layer is initialised from (seed, index) alone, so a
node builds only the layers it holds (a factory's lazily: bamboo/model/factory.py). A
factory model takes byte tokens [batch, seq] and returns logits; its loss is the
PipelineModule's, else next-token cross-entropy.
"""
from __future__ import annotations

import importlib
import sys

import torch
import torch.nn as nn

from bamboo.control.config import ModelSpec
from bamboo.data.corpus import BYTE_VOCAB
from bamboo.model.builtin import MODELS, build_layer, num_layers, token_loss
from bamboo.model.factory import FactoryError, FactoryModel


class ModelError(ValueError):
    """The --model cannot be built."""


class ModelSource:
    def __init__(self, name: str, seed: int, dtype: torch.dtype = torch.float32, seq: int = 32,
                 config_json: str | None = None):
        self.name, self.seed, self.dtype = name, seed, dtype
        self.hf = None      # a Hugging Face family model (bamboo/model/hf.py)
        self.factory = None  # a user's factory, built lazily (bamboo/model/factory.py)
        self.ties: list[tuple[int, str, int, str]] = []  # (layer, parameter) pairs that are one weight
        if name.startswith("hf:") or config_json is not None:
            self._init_hf(name, seq, config_json)
            return
        if name in MODELS:
            self.config = MODELS[name]
            self.count, self.seq, self.loss = num_layers(self.config), self.config.seq, token_loss
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
        try:
            self.factory = FactoryModel(name, factory, seed)
        except FactoryError as e:
            raise ModelError(str(e)) from None
        self.count, self.seq, self.loss = self.factory.count, seq, self.factory.loss or token_loss

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelSource:
        """The job's model, as its config's model section names it."""
        return cls(spec.name, spec.seed, spec.torch_dtype, spec.seq, spec.config_json)

    def _init_hf(self, name: str, seq: int, config_json: str | None) -> None:
        from bamboo.model.hf import HFConfigError, HFModel, causal_lm_loss, load_config

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
        self.config = self.hf.config
        self.count, self.seq, self.loss, self.ties = self.hf.count, seq, causal_lm_loss, self.hf.ties()

    @property
    def vocab(self) -> int:
        """How many token ids the model embeds: a built-in's or a Hugging Face
        config's; a factory model takes byte tokens (256)."""
        if self.hf is not None:
            return self.config.vocab_size
        if self.factory is None:
            return self.config.vocab
        return BYTE_VOCAB

    def _build(self, index: int) -> nn.Module:
        if self.hf is None and self.factory is None:
            return build_layer(self.config, index, self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 7919 + index)
            try:
                return self.hf.build(index) if self.hf is not None else self.factory.build(index)
            except FactoryError as e:
                raise ModelError(str(e)) from None

    def layer(self, index: int) -> nn.Module:
        """Layer `index` with its first values: a new module each call, so a rebuild
        is pristine. A tied weight starts, in every copy, as the first layer of its
        pair built it."""
        layer = self._build(index)
        for first, first_name, second, second_name in self.ties:
            if index == second:
                with torch.no_grad():
                    layer.get_parameter(second_name).copy_(self._build(first).get_parameter(first_name))
        return layer.to(self.dtype)

    def costs(self) -> list[float]:
        """Parameter count per layer, counted on the meta device."""
        if self.factory is not None:
            try:
                layers = [self.factory.shape(i) for i in range(self.count)]
            except FactoryError as e:
                raise ModelError(str(e)) from None
        else:
            with torch.device("meta"):
                layers = [self._build(i) for i in range(self.count)]
        return [float(sum(p.numel() for p in layer.parameters())) or 1.0 for layer in layers]

    def tie(self, layers: list[nn.Module]) -> None:
        """Make each tied pair one parameter, in a list of every layer (the
        single-process reference: one weight, one gradient)."""
        for first, first_name, second, second_name in self.ties:
            owner, _, attr = second_name.rpartition(".")
            setattr(layers[second].get_submodule(owner), attr, layers[first].get_parameter(first_name))
