"""`--export DIR` and bamboo-export: the trained model as one consolidated
safetensors checkpoint.

The workers save one file per layer (`--save-dir`, or a temporary directory),
and a checkpoint holds one snapshot per layer; this gathers either. For a
Hugging Face model DIR is what `from_pretrained` loads: config.json and
model.safetensors under `transformers`' own names, the tied head left out as
`transformers` leaves it out. For other models the keys are
`layers.<i>.<name>`. DIR appears whole or not at all (a temporary sibling,
then a rename).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable

import torch

from bamboo.model.api import ModelSource


class ExportError(ValueError):
    """DIR cannot be written."""


def check_target(directory: str, flag: str = "--export") -> None:
    """Fail before training if DIR is taken or its parent cannot take it."""
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise ExportError(f"{flag} {directory!r}: exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(directory))
    try:
        os.makedirs(parent, exist_ok=True)
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise ExportError(f"{flag} {directory!r}: cannot write there ({e.strerror or e})") from None


def consolidated(state_of: Callable[[int], dict], source: ModelSource) -> dict[str, torch.Tensor]:
    """Every layer's parameters (`state_of(index)`) under their checkpoint names."""
    tied_away = {(second, name) for _, _, second, name in source.ties}  # as transformers saves a tied head
    state = {}
    for index in range(source.count):
        for name, value in state_of(index).items():
            if (index, name) in tied_away:
                continue
            key = source.hf.hf_key(index, name) if source.hf is not None else f"layers.{index}.{name}"
            state[key] = value.contiguous()
    return state


def export(layer_dir: str, directory: str, source: ModelSource) -> None:
    """The files --save-dir holds (layer<i>.pt: a layer's parameters)."""
    export_states(lambda i: torch.load(os.path.join(layer_dir, f"layer{i}.pt"), weights_only=True), directory, source)


def export_states(state_of: Callable[[int], dict], directory: str, source: ModelSource) -> None:
    from safetensors.torch import save_file

    check_target(directory)
    parent = os.path.dirname(os.path.abspath(directory))
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(consolidated(state_of, source), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt", "bamboo_model": source.name})
        if source.hf is not None:
            config = source.config.__class__.from_dict(source.config.to_dict())
            config.architectures = ["GPT2LMHeadModel" if config.model_type == "gpt2" else "LlamaForCausalLM"]
            config.dtype = str(source.dtype).removeprefix("torch.")
            config.to_json_file(os.path.join(tmp, "config.json"))
        else:
            with open(os.path.join(tmp, "bamboo.json"), "w") as f:
                json.dump({"model": source.name, "layers": source.count}, f)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)  # mkdtemp's is 0700
        if os.path.isdir(directory):
            os.rmdir(directory)  # empty (check_target)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
