"""A replica's sync in buckets (bamboo/runtime/sync.py): cut as a brute force says,
posted during the backward, joined by the holder into exactly the owner's
gradients, and counted as one message only once its last part landed."""
import copy
import random

import pytest
import torch
import torch.nn as nn

from schedules.ir import Op

from bamboo.model import recipe
from bamboo.runtime.sync import EarlySync, buckets, receive, sync_params
from tests.gloo import comm_pair


@pytest.mark.parametrize("seed", range(20))
def test_buckets_are_the_longest_runs_that_fit(seed):
    rng = random.Random(seed)
    params = [nn.Parameter(torch.zeros(rng.randint(1, 40))) for _ in range(rng.randint(1, 12))]
    limit = 4 * rng.randint(1, 60)
    plan = buckets(params, limit)
    assert [i for run in plan for i in run] == list(range(len(params)))  # every one, in order
    sizes = [[params[i].numel() * 4 for i in run] for run in plan]
    for k, run in enumerate(sizes):
        assert sum(run) <= limit or len(run) == 1
        if k + 1 < len(sizes):  # the next parameter would not have fitted
            assert sum(run) + sizes[k + 1][0] > limit


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    m.unused = nn.Parameter(torch.ones(8))  # never gets a gradient: its bucket waits for the instruction
    m[0].bias.requires_grad_(False)  # frozen: takes no hook and holds no bucket back; its zeros travel
    return m


def test_the_holder_joins_the_buckets_into_the_owners_gradients():
    owner, holder = comm_pair()
    m = model()
    posted = []  # (the backward still running, elements still to come)
    in_backward = [False]

    def post(t, note):
        posted.append((in_backward[0], note))
        owner.post(20, Op.SEND_SYNC, t, note, later=True)
    x = torch.randn(8, 16)
    m(x).sum().backward()  # an earlier microbatch: the sync is armed before the stage's last backward only
    early = EarlySync(0, 1, m, post, bucket_bytes=1200)
    assert len(early.plan) == 5 and early.plan[-1] == [len(list(m.parameters())) - 1]  # the unused one, alone
    in_backward[0] = True
    m(x).pow(2).sum().backward()
    in_backward[0] = False
    during = len(posted)
    assert during == len(early.plan) - 1  # the last bucket (the unused parameter's) waits for the instruction

    holder.expect(10, Op.SEND_SYNC, 1)
    parts = []
    for _ in range(during):
        parts.append(holder.recv_noted(10, Op.SEND_SYNC))
    assert holder.counts()[(10, Op.SEND_SYNC)] == 0  # parts have landed; the message has not
    early.finish()
    assert len(posted) == len(early.plan) and all(n for _, n in posted[:-1]) and posted[-1][1] is None
    assert [b for b, _ in posted] == [True] * during + [False] * (len(posted) - during)
    flat = receive(parts, lambda: holder.recv_noted(10, Op.SEND_SYNC))
    assert holder.counts()[(10, Op.SEND_SYNC)] == 1
    assert torch.equal(flat, torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                        for p in reversed(list(m.parameters()))]))
    replica = copy.deepcopy(m)
    replica.zero_grad(set_to_none=True)
    recipe.set_flat_grads(sync_params(replica), flat)
    for a, b in zip(m.parameters(), replica.parameters()):
        assert torch.equal(a.grad if a.grad is not None else torch.zeros_like(a), b.grad)
    owner.flush(lambda peer: False)


def test_no_hook_is_left_once_the_sync_is_closed():
    m = model()
    posted = []
    early = EarlySync(0, 1, m, lambda t, note: posted.append(note), bucket_bytes=1200)
    early.close()
    m(torch.randn(2, 16)).sum().backward()
    assert posted == [] and early.handles == []
