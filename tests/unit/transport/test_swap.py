"""Swapping FRC intermediates out and back: the same gradients, and no leak."""
import gc
import weakref

import pytest
import torch

from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage, dropout_seed
from bamboo.transport.swap import SavedTensors


def _stage():
    source = ModelSource("tiny", seed=0)
    return Stage([source.layer(i) for i in range(1, 4)])


def test_backward_after_swap_round_trip_gives_identical_gradients():
    stage = _stage()
    x = torch.randn(2, 32, 32)
    g = torch.randn(2, 32, 32)
    with dropout_seed(5):
        stage(x.requires_grad_()).backward(g)
    want = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad()
    saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
    with dropout_seed(5), saved.recording():
        y = stage(x.detach().requires_grad_())
    assert saved.nbytes() > 0
    saved.swap_out()
    with pytest.raises(RuntimeError, match="swap_in first"):
        y.backward(g, retain_graph=True)
    saved.swap_in()
    y.backward(g)
    assert all(torch.equal(a, p.grad) for a, p in zip(want, stage.parameters()))


@pytest.mark.parametrize("swap", [False, True])
def test_an_unused_frc_graph_is_freed(swap):
    """FRC results that BRC never needed must go with their iteration (a saved
    output once tied its graph to the container in a cycle gc could not break)."""
    stage = _stage()
    saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
    with dropout_seed(1), saved.recording():
        y = stage(torch.randn(2, 32, 32, requires_grad=True))
    if swap:
        saved.swap_out()
    ref = weakref.ref(saved)
    del saved, y
    gc.collect()
    assert ref() is None
