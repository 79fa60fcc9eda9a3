"""Moving layers between configurations: who holds what after failures, the plan
(checked by brute force over random holdings), and a real transfer over gloo."""
import random
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bamboo.control.assignment import Assignment
from bamboo.state import handover
from bamboo.state.checkpoint import restore, snapshot
from bamboo.transport.groups import interruptible


def test_holders_after_a_takeover():
    a = Assignment.static(stages=4, pipelines=2)
    held = a.holders(failed=[1])
    assert held[0] == {0, 1}            # took stage 1 over; its replica (stage 1) became owned
    assert held[2] == {2, 3} and held[3] == {3, 0}
    assert 1 not in held
    assert held[4] == {0, 1} and held[7] == {3, 0}  # pipeline 1 untouched
    assert a.holders([], redundancy="off")[5] == {1}


@pytest.mark.parametrize("seed", range(40))
def test_plan_moves_each_missing_layer_once_from_a_holder(seed):
    rng = random.Random(seed)
    layers = range(rng.randint(1, 8))
    have = {n: {i for i in layers if rng.random() < 0.4} for n in range(rng.randint(1, 5))}
    held = set().union(*have.values())
    need = {n: {i for i in held if rng.random() < 0.5} for n in range(rng.randint(1, 6))}
    moves = handover.plan(have, need)
    missing = sorted((dst, i) for dst, wanted in need.items() for i in wanted if i not in have.get(dst, set()))
    assert sorted((dst, i) for i, _, dst in moves) == missing
    assert all(i in have[src] and src != dst for i, src, dst in moves)


def test_plan_spreads_sends_over_holders():
    """Three full copies, two empty newcomers: eight layers to send, 3/3/2."""
    moves = handover.plan({0: set(range(4)), 1: set(range(4)), 2: set(range(4))}, {5: set(range(4)), 6: set(range(4))})
    sends = [src for _, src, _ in moves]
    assert len(moves) == 8 and sorted(sends.count(n) for n in range(3)) == [2, 3, 3]


def test_a_layer_nobody_holds_is_named():
    with pytest.raises(handover.LayerLost, match=r"\[3\]"):
        handover.plan({0: {0, 1}}, {1: {1, 3}})


def test_a_layer_and_its_optimizer_state_travel_over_gloo():
    torch.manual_seed(0)
    src_layer, dst_layer = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    src_opt = torch.optim.AdamW(src_layer.parameters(), lr=0.1)
    src_layer(torch.randn(2, 4)).sum().backward()
    src_opt.step()
    dst_opt = torch.optim.AdamW(dst_layer.parameters(), lr=0.1)
    store = dist.HashStore()
    moves = [(7, 10, 20)]  # layer 7 from node 10 to node 20
    out = {}

    def node(me, rank):
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        layers = {7: src_layer} if me == 10 else {}
        blob_of = lambda i: snapshot({i: layers[i]}, src_opt)[i]  # noqa: E731
        out[me] = handover.execute(pg, {10: 0, 20: 1}, me, moves, blob_of)
    threads = [threading.Thread(target=node, args=a) for a in ((10, 0), (20, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out[10] == {} and list(out[20]) == [7]
    restore(out[20][7], dst_layer, dst_opt)
    for a, b in zip(src_layer.parameters(), dst_layer.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(src_opt.state[a][key], dst_opt.state[b][key], rtol=0, atol=0)


def test_any_error_of_an_interruptible_call_reaches_the_caller():
    """A KeyError inside the waited-for call (once a standby node's own id missing
    from a handover's members) is raised in the caller at once, not lost in the
    thread while the caller waits for a reason to give up."""
    asked = []

    def give_up():
        asked.append(1)
        return "gave up" if len(asked) > 4 else None
    with pytest.raises(KeyError):
        interruptible(lambda: {}[6], give_up, every=0.5)
    assert len(asked) <= 1
