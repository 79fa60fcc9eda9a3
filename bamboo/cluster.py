"""The job's shared state in etcd: typed reads and writes of the protocol's keys
(bamboo/protocol.py names them all), and the small operations built on them."""
from __future__ import annotations

import json
import threading
import time

from pyetcd import Etcd3Exception
from pyetcd.utils import prefix_range_end

from bamboo.assignment import Assignment
from bamboo.etcd import connect
from bamboo.protocol import ALIVE, ASSIGNMENT, FAILED, LEASE_EXPIRED, MEMBERS, Alive, Failure, Key, job_root


class EtcdLost(Exception):
    """etcd did not answer for the whole patience: a failure of the control plane,
    never to be mistaken for a peer's (so not a RuntimeError, which gloo raises)."""


def _encode(key: Key, record) -> str:
    if not key.complete:
        raise ValueError(f"{key.path}: a value needs the whole key ({', '.join(key.family.params)})")
    if not isinstance(record, key.family.record):
        raise TypeError(f"{key.family.name} holds {key.family.record.__name__}, not {type(record).__name__}")
    return json.dumps(record.to_dict())


class Cluster:
    """The job's keys. Each call retries for `patience` seconds while etcd is
    unreachable (a restart, a slow disk), then raises."""

    def __init__(self, endpoint: str, job: str, patience: float = 20.0):
        self.endpoint = endpoint
        self.client = connect(endpoint)
        self.root = job_root(job)
        self.patience = patience
        self._lease = None

    def _call(self, fn):
        deadline = time.monotonic() + self.patience
        while True:
            try:
                return fn()
            except (Etcd3Exception, ValueError) as e:  # ValueError: pyetcd's endpoint marked failed
                if time.monotonic() > deadline:
                    raise EtcdLost(f"etcd at {self.endpoint} did not answer for {self.patience:.0f} s "
                                   f"({type(e).__name__}: {e})") from None
                time.sleep(0.2)

    def key(self, key: Key | str) -> str:
        """The raw etcd key of a protocol key (or of a store prefix from the protocol)."""
        return self.root + (key if isinstance(key, str) else key.path)

    def put(self, key: Key, record, lease=None) -> None:
        value = _encode(key, record)
        self._call(lambda: self.client.put(self.key(key), value, lease=lease))

    def create(self, key: Key, record) -> bool:
        """Write only if absent (an etcd transaction); True when this call wrote it."""
        value = _encode(key, record)
        return bool(self._call(lambda: self.client.put_if_not_exists(self.key(key), value)))

    def create_clearing(self, key: Key, record, clear: list[Key]) -> bool:
        """create(key, record) and, in the same transaction, delete each key in
        `clear` and every key under it: only the writer that creates the key clears."""
        tx = self.client.transactions
        raw, value = self.key(key), _encode(key, record)
        deletes = [op for c in clear for op in (
            tx.delete(self.key(c)), tx.delete(self.key(c) + "/", range_end=prefix_range_end(f"{self.key(c)}/".encode())))]
        ok, _ = self._call(lambda: self.client.transaction(compare=[tx.version(raw) == 0],
                                                           success=[tx.put(raw, value), *deletes], failure=[]))
        return bool(ok)

    def get(self, key: Key):
        """The record at `key`, or None."""
        value, _ = self._call(lambda: self.client.get(self.key(key)))
        return None if value is None else key.family.record.from_dict(json.loads(value))

    def children(self, prefix: Key) -> dict:
        """{the parts below the prefix (an int, or a tuple): record} for every key under it."""
        raw = self.key(prefix) + "/"
        family = prefix.family
        return {family.parse(meta.key.decode()[len(raw):]): family.record.from_dict(json.loads(value))
                for value, meta in self._call(lambda: list(self.client.get_prefix(raw)))}

    def wait_for(self, predicate, timeout: float, what: str, poll: float = 0.02):
        """Poll until predicate() returns something truthy; TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(poll)

    def register(self, node: int, ttl: float, on_lost=None) -> None:
        """ALIVE(node) under a lease refreshed by a daemon thread every ttl/3.
        `on_lost()` runs if the lease expired anyway (the node was paused or cut
        off long enough for its peers to count it dead)."""
        self._lease = self.client.lease(max(1, int(round(ttl))))
        self.put(ALIVE(node), Alive(node), lease=self._lease)

        def refresh():
            while True:
                time.sleep(max(0.2, ttl / 3))
                try:
                    replies = self._lease.refresh()
                except Exception:  # etcd briefly unreachable: try again next round
                    continue
                if on_lost and replies and replies[0].TTL <= 0:
                    on_lost()
                    return
        threading.Thread(target=refresh, daemon=True, name="lease").start()

    def record_silent(self, nodes, iteration: int, by: int, starting=()) -> list[int]:
        """Record as dead each of `nodes` whose lease is gone; return them. Nodes in
        `starting` (their worker may not run yet) count as alive while their agent is."""
        alive = self.alive()
        if starting:
            alive |= set(self.children(MEMBERS())) & set(starting)
        silent = sorted(n for n in nodes if n not in alive)
        for n in silent:
            self.create(FAILED(n), Failure(iteration, by, LEASE_EXPIRED))
        return silent

    def alive(self) -> set[int]:
        return set(self.children(ALIVE()))

    def failed(self) -> dict[int, Failure]:
        return self.children(FAILED())

    # -- configuration epochs -----------------------------------------------------------
    def assignments(self) -> dict[int, Assignment]:
        return self.children(ASSIGNMENT())

    def latest_assignment(self) -> Assignment:
        found = self.assignments()
        if not found:
            raise RuntimeError("the job has no assignment in etcd")
        return found[max(found)]

    def assignment_at(self, iteration: int) -> Assignment:
        """The assignment iteration `iteration` runs under."""
        return max((a for a in self.assignments().values() if a.start <= iteration), key=lambda a: a.epoch)

    def close(self) -> None:
        self.client.close()
