"""Hugging Face causal LMs (GPT-2 and Llama families) as pipeline layer lists.

`--model hf:NAME` (a named size) or `--model-config FILE.json` (any config of
those families, read offline) is split into [embedding, block x L, final norm,
head]. The layers are `transformers`' own modules (GPT2Block, LlamaDecoderLayer,
their norms), called with the causal mask, positions and rotary embeddings built
by `transformers`' own functions, so a pipeline computes what
`AutoModelForCausalLM` computes. Layer i is initialised by the family's own
`_init_weights` under a seed from (seed, i) alone; with tied embeddings the
head's weight starts as the embedding's and the two copies stay equal because
their gradients are summed before every step (`ModelSource.ties`).

Names in a layer's state dict map one to one onto the `transformers` checkpoint
(`hf_key`), which is how `--export` writes a directory `from_pretrained` loads.
"""
from __future__ import annotations

import contextlib
import inspect
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import CONFIG_MAPPING
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2PreTrainedModel
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaPreTrainedModel, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from bamboo.model.builtin import layer_rng
from bamboo.model.sizes import NAMED

FAMILIES = ("gpt2", "llama")
# The mask's "no cache" argument: `cache` since transformers 5.2x, `past_key_values`
# before (5.40 drops that name).
_NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}


class HFConfigError(ValueError):
    """The named size or config file cannot be used."""


def load_config(name: str | None, text: str | None):
    """The `transformers` config of `hf:NAME` or of a config.json's text, read
    offline; attention through torch's SDPA, as `from_pretrained` picks."""
    if text is not None:
        where = "--model-config"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise HFConfigError(f"{where}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise HFConfigError(f"{where}: expected a JSON object")
    else:
        if name not in NAMED:
            raise HFConfigError(f"--model hf:{name}: unknown size (known: {', '.join(NAMED)})")
        raw, where = dict(NAMED[name]), f"--model hf:{name}"
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise HFConfigError(f"{where}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = CONFIG_MAPPING[family](**fields)
    except (TypeError, ValueError) as e:
        raise HFConfigError(f"{where}: {e}") from None
    config._attn_implementation = "sdpa"
    if getattr(config, "add_cross_attention", False):
        raise HFConfigError(f"{where}: cross-attention is not a causal LM")
    for size in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        value = getattr(config, size)
        if not isinstance(value, int) or value < 1:  # the name the file used (GPT-2's are aliases)
            named = config.attribute_map.get(size) if config.attribute_map.get(size) in raw else size
            raise HFConfigError(f"{where}: {named} must be a whole number of at least 1 (got {value!r})")
    return config


class _Layer(nn.Module):
    """Runs its body under this layer's own dropout seed: the math does not depend
    on which stage the layer lands on."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with layer_rng(self.index, x.device) if self.training else contextlib.nullcontext():
            return self.body(x)


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


class GPT2Embedding(_Layer):
    def __init__(self, config, index: int):
        super().__init__(index)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def body(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(tokens) + self.wpe(_positions(tokens)))


class LlamaEmbedding(_Layer):
    def __init__(self, config, index: int):
        super().__init__(index)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def body(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class Block(_Layer):
    """One decoder block; the mask (and for Llama the rotary cos/sin) made as the
    `transformers` model makes them for a batch without padding or cache."""

    def __init__(self, config, index: int):
        super().__init__(index)
        self.config = config
        if config.model_type == "gpt2":
            self.block = GPT2Block(config, layer_idx=index - 1)
            self.rotary = None
        else:
            self.block = LlamaDecoderLayer(config, layer_idx=index - 1)
            self.rotary = LlamaRotaryEmbedding(config=config)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        positions = _positions(x)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, position_ids=positions,
                                  **_NO_CACHE)
        if self.rotary is None:
            return self.block(x, attention_mask=mask)
        return self.block(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(x, position_ids=positions))


class FinalNorm(_Layer):
    def __init__(self, config, index: int):
        super().__init__(index)
        if config.model_type == "gpt2":
            self.norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        else:
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class Head(_Layer):
    def __init__(self, config, index: int):
        super().__init__(index)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in float32, as `transformers`' ForCausalLMLoss
    (our labels are already shifted)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class HFModel:
    """One family config as a layer list: what ModelSource needs."""

    def __init__(self, config):
        self.config = config
        self.blocks = config.num_hidden_layers
        self.count = self.blocks + 3
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.max_seq = config.max_position_embeddings
        family = GPT2PreTrainedModel if config.model_type == "gpt2" else LlamaPreTrainedModel
        self._initialiser = family(config)  # holds no layers: lends its _init_weights

    def build(self, index: int) -> nn.Module:
        """Layer `index`, initialised by the family's `_init_weights` (under the
        caller's RNG state). The caller seeds it."""
        if index == 0:
            cls = GPT2Embedding if self.config.model_type == "gpt2" else LlamaEmbedding
            layer = cls(self.config, index)
        elif index <= self.blocks:
            layer = Block(self.config, index)
        elif index == self.blocks + 1:
            layer = FinalNorm(self.config, index)
        else:
            layer = Head(self.config, index)
        layer.apply(self._initialiser._init_weights)
        return layer

    def ties(self) -> list[tuple[int, str, int, str]]:
        """(layer, parameter, layer, parameter) pairs that are one weight."""
        embedding = "wte.weight" if self.config.model_type == "gpt2" else "embed_tokens.weight"
        return [(0, embedding, self.count - 1, "lm_head.weight")] if self.tied else []

    def hf_key(self, index: int, name: str) -> str:
        """The `transformers` checkpoint key of layer `index`'s parameter `name`."""
        base = "transformer" if self.config.model_type == "gpt2" else "model"
        if index == 0:
            return f"{base}.{name}"
        if index <= self.blocks:
            return f"{base}.{'h' if base == 'transformer' else 'layers'}.{index - 1}.{name.removeprefix('block.')}"
        if index == self.blocks + 1:
            return f"{base}.{'ln_f' if base == 'transformer' else 'norm'}.{name.removeprefix('norm.')}"
        return name

