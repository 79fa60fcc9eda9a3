"""--transport nccl's channels (bamboo/transport/channels.py), run on the CPU with gloo groups:
a group per directed channel, payloads in order in both directions at once (the
replica sync of P=2 flows both ways between one pair), and the abort that ends a
wait on a dead peer's channel."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from schedules.ir import Op

from bamboo.transport.channels import Channels, gloo_groups
from bamboo.transport.comm import Comm, PeerFailure
from tests.gloo import gloo_pair


def pair() -> tuple[list[Comm], list[Channels]]:
    """Nodes 0 and 1, each a Comm on one world gloo group with channels over gloo."""
    store = dist.HashStore()
    pgs = gloo_pair(store, timeout=20)

    def store_for(src: int, dst: int, kind: str) -> dist.Store:
        return dist.PrefixStore(f"channel/{src}-{dst}/{kind}", store)
    channels = [Channels(store_for, node, gloo_groups(20), nccl=False) for node in (0, 1)]
    comms = [Comm(pgs[n], {0: 0, 1: 1}, torch.device("cpu"), channels=channels[n]) for n in (0, 1)]
    return comms, channels


def test_payloads_go_on_a_group_per_channel_both_ways_at_once():
    comms, channels = pair()
    sent = {(src, kind): [torch.full((3, 2), float(10 * src + i)) for i in range(4)]
            for src in (0, 1) for kind in (Op.SEND_ACT, Op.SEND_SYNC)}
    got: dict = {}

    def node(me: int) -> None:
        peer = 1 - me
        for kind in (Op.SEND_ACT, Op.SEND_SYNC):
            comms[me].expect(peer, kind, 4)
        for i in range(4):  # every send posted first: nothing waits for a receive
            for kind in (Op.SEND_ACT, Op.SEND_SYNC):
                comms[me].post(peer, kind, sent[(me, kind)][i], note=float(i) if kind is Op.SEND_ACT else None)
        for kind in (Op.SEND_ACT, Op.SEND_SYNC):
            got[(peer, kind)] = [comms[me].recv_noted(peer, kind) for _ in range(4)]
        comms[me].flush(lambda p: False)
    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for (src, kind), messages in got.items():
        assert [t.tolist() for t, _ in messages] == [t.tolist() for t in sent[(src, kind)]]
        assert [note for _, note in messages] == ([0.0, 1.0, 2.0, 3.0] if kind is Op.SEND_ACT else [None] * 4)
    # one group per (sender, receiver, kind): 0->1 and 1->0, activations and syncs
    assert sorted(channels[0]._groups) == sorted(channels[1]._groups) == [
        (0, 1, "send_act"), (0, 1, "send_sync"), (1, 0, "send_act"), (1, 0, "send_sync")]
    assert comms[1].counts()[(0, Op.SEND_ACT)] == 4


@pytest.mark.parametrize("how", ["abort_peer", "close"])
def test_an_aborted_channel_ends_the_wait_and_settles(how):
    """Node 0 dies between a message's header and its payload: node 1's mailbox
    waits on the channel (NCCL's would wait forever) until the failover aborts it,
    or the world is closed (an abandoned iteration, a new world)."""
    comms, channels = pair()
    comms[1].expect(0, Op.SEND_ACT, 1)
    header = torch.zeros(11, dtype=torch.int64)
    header[0], header[1], header[-1] = 1, 4, 0  # a float32 vector of 4
    comms[0].pg.send([header], 1, 1).wait()  # the header only
    channels[0].group(0, 1, Op.SEND_ACT)  # node 0's end of the channel, then nothing
    failure: list = []

    def receive() -> None:
        try:
            comms[1].recv(0, Op.SEND_ACT, keep_waiting=lambda: True, poll=0.05)
        except PeerFailure as e:
            failure.append(str(e))
    waiting = threading.Thread(target=receive)
    waiting.start()
    time.sleep(0.5)  # the receive is under way: nothing ends it but the abort
    assert waiting.is_alive() and not comms[1].settled(0)
    comms[1].abort_peer(0) if how == "abort_peer" else comms[1].close()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and "aborted" in failure[0]
    assert comms[1].settled(0) and comms[1].counts()[(0, Op.SEND_ACT)] == 0


def test_without_channels_abort_changes_nothing():
    store = dist.HashStore()
    comm = Comm(dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=5)), {0: 0}, torch.device("cpu"))
    comm.abort_peer(0)  # gloo's world channels break by themselves
    assert comm.channels is None
