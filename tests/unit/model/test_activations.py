"""layer_bytes against autograd itself: each layer's bytes, fitted from tiny
shapes on uninitialised layers, equal what the model's real layers save at the
job's own shape when run one after another on real tokens."""
import pytest
import torch

from bamboo.model.activations import layer_bytes
from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage, dropout_seed
from bamboo.transport.swap import SavedTensors


def direct(source: ModelSource, batch: int, seq: int, autocast=None) -> list[tuple[int, int]]:
    """Per layer: bytes of the distinct storages autograd saves (parameters left
    out), and what an FRC swap-out copies of them (SavedTensors' own count)."""
    tokens = torch.randint(0, source.vocab, (batch, seq))
    x, out = tokens, []
    for index in range(source.count):
        layer = source.layer(index).train()
        last = index == source.count - 1
        params = {p.data_ptr() for p in layer.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        cast = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dropout_seed(1), cast:
            y = Stage([layer], source.loss if last else None)(x, tokens if last else None)
        swap = SavedTensors(params)
        with swap.recording(), dropout_seed(1), cast:
            Stage([layer], source.loss if last else None)(x, tokens if last else None)
        out.append((sum(storages.values()), swap.nbytes()))
        x = y.detach().requires_grad_(y.is_floating_point())
    return out


@pytest.mark.parametrize("model,seq,batch", [("hf:llama-tiny", 100, 3), ("hf:gpt2-tiny", 77, 2), ("tiny", None, 5)])
def test_fitted_bytes_are_what_autograd_saves_at_the_jobs_shape(model, seq, batch):
    source = ModelSource(model, 0, seq=seq or 32)
    seq = source.seq
    fitted = layer_bytes(source)
    for index, (kept, swapped) in enumerate(direct(source, batch, seq)):
        assert fitted[index].saved(batch, seq) == kept, (model, index)
        assert fitted[index].swapped.at(batch, seq) == swapped, (model, index)


def test_a_layers_output_is_what_the_next_stage_receives():
    source = ModelSource("hf:llama-tiny", 0, seq=64)
    fitted = layer_bytes(source)
    hidden = source.config.hidden_size
    assert [f.output(3, 64) for f in fitted[:-1]] == [3 * 64 * hidden * 4] * (source.count - 1)
    assert fitted[-1].output(3, 64) == 0  # the loss leaves the pipeline, it is not sent on


def test_under_bf16_autocast_too():
    """Autocast keeps bf16 activations, and each weight's bf16 copy for the backward."""
    source = ModelSource("hf:llama-tiny", 0, seq=64)
    fitted = layer_bytes(source, torch.bfloat16)
    measured = direct(source, 2, 64, torch.bfloat16)
    assert [f.saved(2, 64) for f in fitted] == [kept for kept, _ in measured]
    assert sum(f.saved(2, 64) for f in fitted) < sum(f.saved(2, 64) for f in layer_bytes(source))
