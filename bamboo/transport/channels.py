"""Payloads over one two-rank group per directed channel: `--transport nccl`.

NCCL runs a communicator's point-to-point operations one after another on one
stream, so channels that share a communicator wait on each other: with P=2, stage
0's activations to node 1 and node 1's replica sync to node 0 would deadlock on the
pair's one communicator. Each (sender, receiver, kind) therefore gets a group of its
own, made by both ends the first time the channel is used (the rendezvous is under
the world's store key, so a new world makes new channels). Headers (shape,
dtype, the loss note) still go over the world's gloo group: a mailbox knows a
payload's size before it posts the receive, and the channel counts of
bamboo/transport/comm.py stay what the failover reads.

A dead peer never breaks an NCCL channel: its pending operations would wait until
NCCL's watchdog ends the process. The failover, once it knows the peer is dead,
calls `abort(peer)`: the peer's groups are aborted and any wait on them gives up
(the mailbox records the channel broken, so `Comm.settled` holds). An abandoned
iteration, or a new world, closes them all (`close`).

The same code runs with gloo groups (`gloo_groups`): how the tests exercise it on
the CPU, where NCCL does not exist.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from schedules.ir import Op

from bamboo.control.config import Transport
from bamboo.transport.groups import GroupMaker, interruptible

POLL_SECONDS = 0.0002  # how often a wait on a channel asks whether its work is done
# Tests set this to run the channels over gloo groups on the CPU, where NCCL is not
# at hand: the workers then take this module's path with `gloo_groups`.
CHANNELS_ON_CPU = "BAMBOO_CHANNELS_ON_CPU"

StoreFor = Callable[[int, int, str], dist.Store]  # (sender, receiver, kind) -> where the channel meets


def nccl_groups(timeout: float) -> GroupMaker:
    """NCCL groups whose operations give up after `timeout` seconds (--hang-timeout;
    NCCL's watchdog then ends the process). Non-blocking communicators: one is made
    at its first operation, on the GPU the calling thread set, without blocking
    that thread, so a wait on it can be given up and the group aborted."""
    def make(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return make


def gloo_groups(timeout: float) -> GroupMaker:
    return lambda store, rank, size: dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))


def for_worker(transport: str, store_for: StoreFor, me: int, timeout: float) -> "Channels | None":
    """A worker's channels: NCCL's with `--transport nccl`, gloo's under
    BAMBOO_CHANNELS_ON_CPU=1 (tests), else none (gloo's world group carries all)."""
    if transport == Transport.NCCL:
        return Channels(store_for, me, nccl_groups(timeout), nccl=True)
    if os.environ.get(CHANNELS_ON_CPU) == "1":
        return Channels(store_for, me, gloo_groups(timeout), nccl=False)
    return None


class ChannelAborted(RuntimeError):
    """A channel whose peer the failover declared dead, or of a world that was
    closed (gloo's waits say so with RendezvousAborted, from `interruptible`)."""


class Channels:
    def __init__(self, store_for: StoreFor, me: int, make_group: GroupMaker, nccl: bool):
        self.store_for, self.me, self._make, self.nccl = store_for, me, make_group, nccl
        self._groups: dict[tuple[int, int, str], dist.ProcessGroup] = {}
        self.aborted: set[int] = set()  # peers whose channels were aborted
        self.closed = False               # every channel given up (the world is done)

    def group(self, src: int, dst: int, kind: Op) -> dist.ProcessGroup:
        """The channel's group: rank 0 sends, rank 1 receives. Each channel is used
        by one thread per end (its outbox, its mailbox), so no lock is needed. It
        meets where `store_for` says: a store that gives up when one of the two
        ends is gone, not when any node of the world is (a recovery opens channels
        after a death)."""
        key = (src, dst, kind.value)
        if reason := self._gone(dst if src == self.me else src):
            raise ChannelAborted(reason)
        if key not in self._groups:
            self._groups[key] = self._make(self.store_for(src, dst, kind.value), 0 if self.me == src else 1, 2)
        return self._groups[key]

    def wait(self, work, peer: int) -> None:
        """Until `work` is done, or its peer's channels are aborted; raises what the
        work raised. NCCL's work is asked (its CUDA event: no stream waits); gloo's
        says it is done only once waited for, so a thread waits on it."""
        if not self.nccl:
            interruptible(work.wait, lambda: self._gone(peer), every=0.01)
            return
        while not work.is_completed():
            if reason := self._gone(peer):
                raise ChannelAborted(reason)
            time.sleep(POLL_SECONDS)
        work.wait()

    def _gone(self, peer: int) -> str | None:
        """Why the channels with `peer` are given up, or None."""
        if peer in self.aborted or self.closed:
            return f"the channel with node {peer} was aborted: it died, or its world ended"
        return None

    def abort(self, peer: int) -> None:
        """Give up every channel with `peer` (it died): waits on them end."""
        self.aborted.add(peer)
        self._abort_groups(lambda src, dst: peer in (src, dst))

    def close(self) -> None:
        """Give up every channel: the iteration was abandoned, or a new world
        replaces this one (NCCL's communicators hold GPU memory until aborted)."""
        self.closed = True
        self._abort_groups(lambda src, dst: True)

    def _abort_groups(self, which) -> None:
        """Forget the groups chosen by `which(src, dst)`; NCCL's are aborted (gloo's
        break by themselves when a peer dies, and stay open until the process exits)."""
        for key in [k for k in self._groups if which(k[0], k[1])]:
            pg = self._groups.pop(key)
            if self.nccl:
                pg.abort()
