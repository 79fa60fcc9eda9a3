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
    store = store_at(cluster, store_key, why_not, timeout)
    if make_group is not None:  # NCCL meets its peers at the first operation, not here
        rank_of = {n: i for i, n in enumerate(members)}
        pg = make_group(store, rank_of[me], len(members))
        _KEPT.append((pg, store))
        return pg, rank_of, store
    # gloo's connection step waits inside the constructor, for a member that died
    # after the rendezvous, until the whole op timeout: it is given up sooner.
    pg, rank_of = interruptible(lambda: new_group(store, list(members), me, timeout), why_not)
    _KEPT.append((pg, store))
    return pg, rank_of, store


def interruptible(call, give_up, every: float = 0.5):
    """call()'s result, waited for while asking `give_up()` every `every` seconds;
    RendezvousAborted once it names a reason. The call runs in a thread of its own,
    which, given up, stays blocked until gloo's own timeout (the groups are kept)."""
    done: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            done.put((call(), None))
        except BaseException as e:  # noqa: BLE001 - not swallowed: raised again in the caller's thread
            done.put((None, e))
    threading.Thread(target=run, daemon=True, name="interruptible").start()
    while True:
        try:
            result, error = done.get(timeout=every)
            break
        except queue.Empty:
            reason = give_up()
            if reason:
                raise RendezvousAborted(reason) from None
    if error is not None:
        raise error
    return result


def new_group(store: dist.Store, members: list[int], me: int, timeout: float) -> tuple[dist.ProcessGroup, dict]:
    """A gloo group over `members` (node ids) whose operations give up after
    `timeout` seconds: returns it and node id -> group rank."""
    rank_of = {n: i for i, n in enumerate(members)}
    pg = dist.ProcessGroupGloo(store, rank_of[me], len(members), timedelta(seconds=timeout))
    return pg, rank_of
