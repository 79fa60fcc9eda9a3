"""A torch.distributed Store over etcd v3, so that no worker hosts the rendezvous
and a dead worker never takes the store with it."""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


class RendezvousAborted(TimeoutError):
    """A wait gave up early because a member cannot come any more."""


class EtcdStore(dist.Store):
    """`abort()`, if given, is asked every half second while waiting: a message
    (say, "node 3 lost its lease") ends the wait with RendezvousAborted.
    `retry(fn)`, if given, runs each etcd request (Cluster.call: a request made
    while etcd restarts is tried again rather than failing the rendezvous)."""

    def __init__(self, client, prefix: str, timeout: timedelta = timedelta(seconds=60), abort=None,
                 retry=None):
        super().__init__()
        self.client = client
        self.prefix = prefix.rstrip("/") + "/"
        self._timeout = timeout
        self._abort = abort
        self._etcd = retry or (lambda fn: fn())

    def _key(self, key: str) -> str:
        return self.prefix + key

    @staticmethod
    def _bytes(value) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key, value) -> None:
        self._etcd(lambda: self.client.put(self._key(key), self._bytes(value)))

    def get(self, key) -> bytes:
        self.wait([key])
        value, _ = self._etcd(lambda: self.client.get(self._key(key)))
        return value

    def add(self, key, amount: int) -> int:
        k, tx = self._key(key), self.client.transactions
        while True:
            value, meta = self._etcd(lambda: self.client.get(k))
            new = amount if value is None else int(value) + amount
            cond = tx.version(k) == 0 if value is None else tx.mod(k) == meta.mod_revision
            # not tried again: had etcd applied it before failing, a retry would add twice
            ok, _ = self.client.transaction(compare=[cond], success=[tx.put(k, str(new))], failure=[])
            if ok:
                return new

    def compare_set(self, key, expected, desired) -> bytes:
        k, expected, desired = self._key(key), self._bytes(expected), self._bytes(desired)
        if expected == b"":
            cond = self.client.transactions.version(k) == 0
        else:
            cond = self.client.transactions.value(k) == expected
        self._etcd(lambda: self.client.transaction(compare=[cond], success=[self.client.transactions.put(k, desired)],
                                                   failure=[]))
        value, _ = self._etcd(lambda: self.client.get(k))
        return value if value is not None else expected

    def check(self, keys) -> bool:
        return all(self._etcd(lambda: self.client.get(self._key(k)))[0] is not None for k in keys)

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        start = time.monotonic()
        pause, asked = 0.002, start
        while not self.check(keys):
            now = time.monotonic()
            if now - start > limit:
                raise TimeoutError(f"etcd store: keys {list(keys)} not set within {limit:.0f} s")
            if self._abort and now - asked > 0.5:
                asked = now
                reason = self._abort()
                if reason:
                    raise RendezvousAborted(reason)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def delete_key(self, key) -> bool:
        return bool(self._etcd(lambda: self.client.delete(self._key(key))))

    def num_keys(self) -> int:
        return sum(1 for _ in self._etcd(lambda: list(self.client.get_prefix(self.prefix))))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
