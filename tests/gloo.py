"""Two gloo ranks in one process (a thread each makes its end: a group's rendezvous
blocks until both have come), for tests of point-to-point code."""
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from bamboo.transport.comm import Comm


def gloo_pair(store: dist.Store | None = None, timeout: float = 30) -> list[dist.ProcessGroup]:
    """Ranks 0 and 1 of one gloo group meeting at `store` (a fresh HashStore)."""
    store, groups = store or dist.HashStore(), [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout))
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return groups


def comm_pair() -> tuple[Comm, Comm]:
    """Nodes 10 and 20 (ranks 0 and 1), each a Comm on the CPU."""
    a, b = gloo_pair()
    return Comm(a, {10: 0, 20: 1}, torch.device("cpu")), Comm(b, {10: 0, 20: 1}, torch.device("cpu"))
