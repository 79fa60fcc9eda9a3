"""gloo process groups whose rendezvous is a prefix in etcd (bamboo/control/store.py): the
world of an epoch's live nodes, the handover group, a stage's reduce group. Each
wait gives up as soon as a member can no longer come (its lease ran out), and the
member is recorded dead on the way."""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from bamboo.control.cluster import Cluster
from bamboo.control.store import EtcdStore, RendezvousAborted

# Every group this process opened, kept until it exits: a group whose collective
# failed (a member died) cannot be torn down safely, gloo's destructor may abort.
_KEPT: list[tuple[dist.ProcessGroup, EtcdStore]] = []


def lease_check(cluster: Cluster, members, iteration: int, me: int, starting=()):
    """A callable telling why waiting for `members` is pointless (some lost their
    leases, now recorded dead), or None. Nodes in `starting` count as alive while
    their agent is (their worker may not have registered yet)."""
    def why_not() -> str | None:
        cluster.progress()  # a thread that asks is waiting, not stuck
        gone = cluster.record_silent(members, iteration, me, starting)
        return f"nodes {gone} lost their leases" if gone else None
    return why_not


GroupMaker = Callable[[dist.Store, int, int], dist.ProcessGroup]  # (store, rank, size) -> a group


def store_at(cluster: Cluster, store_key: str, why_not, timeout: float) -> EtcdStore:
    """The etcd store a group meets at, below the job's root; its waits give up
    after `timeout` seconds or once `why_not()` names a reason."""
    return EtcdStore(cluster.client, cluster.key(store_key), timedelta(seconds=timeout), why_not, cluster.call)


def open_group(cluster: Cluster, store_key: str, members, me: int, why_not, timeout: float,
               make_group: GroupMaker | None = None) -> tuple[dist.ProcessGroup, dict[int, int], EtcdStore]:
    """A gloo group (or one `make_group` makes: NCCL's) over `members` (node ids)
    meeting at `store_key` (from bamboo/control/protocol.py): the group, node id -> rank,
    and the store it keeps using. Its rendezvous and each of its operations give up
    after `timeout` seconds (--hang-timeout). The group lives as long as the process
    (see _KEPT)."""
    return start_group(cluster, store_key, members, me, why_not, timeout, make_group).wait(why_not)


def start_group(cluster: Cluster, store_key: str, members, me: int, why_not, timeout: float,
                make_group: GroupMaker | None = None) -> "Opening":
    """open_group's work on a thread of its own: an Opening whose wait gives what
    open_group gives. A caller called away meanwhile waits on the same Opening
    later: a second rendezvous at `store_key` would never meet the first."""
    store = store_at(cluster, store_key, why_not, timeout)
    if make_group is not None:  # NCCL meets its peers at the first operation, not here (on this thread's device)
        rank_of = {n: i for i, n in enumerate(members)}
        pg = make_group(store, rank_of[me], len(members))
        _KEPT.append((pg, store))
        return Opening(result=(pg, rank_of, store))

    def open_() -> tuple[dist.ProcessGroup, dict[int, int], EtcdStore]:
        # gloo's connection step waits inside the constructor, until the whole op timeout
        pg, rank_of = new_group(store, list(members), me, timeout)
        _KEPT.append((pg, store))
        return pg, rank_of, store
    return Opening(open_)


class Opening:
    """A call running on a thread of its own, whose outcome can be waited for, given
    up on, and waited for again. A thread given up on stays blocked until gloo's
    own timeout (the groups are kept)."""

    def __init__(self, call=None, result=None):
        """Runs `call` on its thread; without one, the outcome is `result`."""
        self._done: queue.Queue = queue.Queue(maxsize=1)
        self._outcome: tuple | None = None if call is not None else (result, None)
        if call is not None:
            threading.Thread(target=self._run, args=(call,), daemon=True, name="opening").start()

    def _run(self, call) -> None:
        try:
            self._done.put((call(), None))
        except BaseException as e:  # noqa: BLE001 - not swallowed: raised again in the waiter's thread
            self._done.put((None, e))

    def wait(self, give_up, every: float = 0.5):
        """The call's result, waited for while asking `give_up()` every `every`
        seconds: RendezvousAborted once it names a reason (`give_up` may also raise)."""
        while self._outcome is None:
            try:
                self._outcome = self._done.get(timeout=every)
            except queue.Empty:
                reason = give_up()
                if reason:
                    raise RendezvousAborted(reason) from None
        result, error = self._outcome
        if error is not None:
            raise error
        return result


def interruptible(call, give_up, every: float = 0.5):
    """call()'s result, waited for while asking `give_up()` every `every` seconds;
    RendezvousAborted once it names a reason (see Opening)."""
    return Opening(call).wait(give_up, every)


def new_group(store: dist.Store, members: list[int], me: int, timeout: float) -> tuple[dist.ProcessGroup, dict]:
    """A gloo group over `members` (node ids) whose operations give up after
    `timeout` seconds: returns it and node id -> group rank."""
    rank_of = {n: i for i, n in enumerate(members)}
    pg = dist.ProcessGroupGloo(store, rank_of[me], len(members), timedelta(seconds=timeout))
    return pg, rank_of
