"""A replica's sync, posted in buckets during its stage's last backward.

An owner sends its stage's gradients to the holder of the stage's replica once per
iteration (SEND_SYNC). Sent whole, the message waits for the last backward to end,
and on a GPU over gloo it starts its way through host memory only then. With one
pipeline the reduce leaves the gradients as they are, and without clipping, ties
or fp16 nothing scales them before the step: they are final as the last backward
leaves them. Then the sync is cut into buckets in the order that backward fills
them (the stage's parameters reversed), and each bucket is posted as soon as its
gradients are there, while the backward runs on.

The last bucket waits for the SEND_SYNC instruction. So the holder has the whole
sync only once the owner's stream got there, which the cut relies on: a dead
node's messages count in stream order (`died_before`, bamboo/runtime/failover.py).
A part's note says how many elements are still to come; the holder's mailbox
counts the message once its last part landed (bamboo/transport/comm.py) and
`receive` joins the parts."""
from __future__ import annotations

from typing import Callable

import torch

from bamboo.model import recipe

def sync_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A stage's parameters in the order its sync carries their gradients: the order
    a backward roughly fills them in."""
    return list(module.parameters())[::-1]


def buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """`params`' indexes cut into consecutive runs of at most `bucket_bytes` (a larger
    parameter alone)."""
    out: list[list[int]] = []
    size = 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


class EarlySync:
    """Stage `stage`'s sync to `peer`, posted (`post(tensor, note)`) in buckets of up to
    `bucket_bytes` (--sync-bucket-mb; each is a message, and on a GPU a copy to host
    memory) from hooks that fire as the backward accumulates each gradient, all but
    the last; `finish` posts the rest. The hooks live until `finish` or `close`."""

    def __init__(self, stage: int, peer: int, module: torch.nn.Module, post: Callable, bucket_bytes: int):
        self.stage, self.peer, self.post = stage, peer, post
        self.params = sync_params(module)
        self.plan = buckets(self.params, bucket_bytes)
        # gradients each bucket still waits for (a frozen parameter's never comes: zeros travel)
        self.missing = [sum(self.params[i].requires_grad for i in run) for run in self.plan]
        self.bucket_of = {id(self.params[i]): b for b, run in enumerate(self.plan) for i in run}
        self.left = sum(p.numel() for p in self.params)  # elements not posted yet
        self.posted = 0  # buckets posted, in order
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params if p.requires_grad]

    def _ready(self, param: torch.nn.Parameter) -> None:
        self.missing[self.bucket_of[id(param)]] -= 1
        while self.posted < len(self.plan) - 1 and self.missing[self.posted] == 0:
            self._post_next()

    def _post_next(self) -> None:
        flat = recipe.flat_grads([self.params[i] for i in self.plan[self.posted]])
        self.left -= flat.numel()
        self.posted += 1
        self.post(flat, float(self.left) if self.left else None)

    def finish(self) -> None:
        """At the SEND_SYNC instruction: the buckets not posted yet, the last among them."""
        self.close()
        while self.posted < len(self.plan):
            self._post_next()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def receive(parts: list, recv: Callable) -> torch.Tensor:
    """The whole sync from its parts: `parts` holds those taken so far (it survives a
    wait cut short), `recv()` takes the next (tensor, note); a part's note is how
    many elements are still to come (None: the last)."""
    while not parts or parts[-1][1] is not None:
        parts.append(recv())
    return torch.cat([t for t, _ in parts]) if len(parts) > 1 else parts[0][0]
