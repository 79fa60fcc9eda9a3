"""A layer snapshot comes from storage or from a peer (a handover, a rollback from
memory): both untrusted. A crafted one, whose unpickling would run code, is refused
with one line by the restore path, and the code never runs."""
import io
import os

import pytest
import torch

from bamboo.data.checkpoint_files import CheckpointError
from bamboo.state.checkpoint import restore, snapshot


class RunsCode:
    """What a crafted pickle holds: unpickling it calls os.system."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def layer_and_optimizer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return layer, optimizer


def test_a_crafted_snapshot_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    layer, optimizer = layer_and_optimizer()
    honest = snapshot({0: layer}, optimizer)[0]
    state = torch.load(io.BytesIO(honest), weights_only=True)
    state["optim"]["weight"]["step"] = RunsCode(str(marker))  # hidden where a real value sits
    crafted = io.BytesIO()
    torch.save(state, crafted)
    before = [p.detach().clone() for p in layer.parameters()]
    with pytest.raises(CheckpointError) as refused:
        restore(crafted.getvalue(), layer, optimizer)
    assert not marker.exists()  # nothing ran
    said = str(refused.value)
    assert len(said.splitlines()) == 1 and "not loaded" in said and "system" in said, said
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))  # nothing loaded either


def test_a_snapshot_of_the_wrong_shape_is_refused_and_an_honest_one_loads():
    layer, optimizer = layer_and_optimizer()
    honest = snapshot({0: layer}, optimizer)[0]
    for wrong in ([1, 2], {"params": [1]}, {"params": {}}):
        buf = io.BytesIO()
        torch.save(wrong, buf)
        with pytest.raises(CheckpointError, match="not one"):
            restore(buf.getvalue(), layer, optimizer)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    restore(honest, fresh, fresh_optimizer)  # the reference: what snapshot wrote comes back equal
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), fresh.parameters()))
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"], optimizer.state[layer.weight]["exp_avg"])


def test_a_peer_announcing_more_than_a_layer_can_take_is_refused_before_allocating():
    """A peer's size comes first over gloo: 2^40 bytes for a layer whose snapshot
    is a few hundred kB is refused (nothing allocated), an honest size is not."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from bamboo.control.config import JobConfig
    from bamboo.model.api import ModelSource
    from bamboo.state import handover
    from bamboo.state.holdings import Holdings
    holdings = Holdings(ModelSource("tiny", 0), JobConfig(), torch.device("cpu"))
    layer = ModelSource("tiny", 0).layer(1)
    optimizer = torch.optim.AdamW(layer.parameters())
    sum(p.sum() for p in layer.parameters()).backward()
    optimizer.step()
    honest = len(snapshot({1: layer}, optimizer)[1])
    assert honest < holdings.blob_bound(1) < 40 * honest  # room for fp16 with fp32 masters, not for an attack
    store, outcome = dist.HashStore(), {}

    def liar():
        pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=30))
        pg.send([torch.tensor([1 << 40], dtype=torch.int64)], 1, handover._TAG + 1).wait()

    def receiver():
        pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=30))
        try:
            handover.execute(pg, {10: 0, 20: 1}, 20, [(1, 10, 20)], None, max_bytes=holdings.blob_bound)
        except handover.OversizedLayer as e:
            outcome["refused"] = str(e)
    threads = [threading.Thread(target=liar), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert outcome["refused"].startswith(f"node 10 announced {1 << 40} bytes for layer 1 (a snapshot of it takes "
                                         f"at most {holdings.blob_bound(1)})")
