"""The job's shared state in etcd, key by key, and the small operations on it.

Keys, all under /bamboo/<job>/:

    alive/<node>               the node id, bound to its lease: gone when it stops refreshing
    failed/<node>              {"iteration", "by"}: first detector wins (create-if-absent)
    cut/<iter>/<dead>/<node>   messages <node> received from <dead> in <iter>, per kind
    finished/<iter>/<node>     the node ran its whole stream (it stays to help its pipeline)
    loss/<iter>/<mb>           loss of global microbatch <mb>, written before its gradient leaves
    done/<iter>/<node>         a node's iteration report (memory, digests, events)
    abort/<iter>               {"why", "by"}: no pipeline can finish <iter>; it is redone
    aborted/<iter>/<node>      the node undid its steps of <iter> and waits for the agents
    regroup/<iter>/<try>       {"failed", "reconfigure"}: failed nodes every worker uses from
                               <iter> + 1 on, and whether the agents must reconfigure first
                               (first writer wins; a new try when a node dies while regrouping)
    reduced/<iter>/<stage>     members of a finished data-parallel reduce of <stage>
    assignment/<epoch>         node -> (pipeline, stage) from an iteration on (agents/membership.py)
    checkpointed               when the last checkpoint was decided (for --checkpoint-seconds)
    preempted/<node>           {"iteration", "time"} of an injected SIGKILL
    error/<node>               a worker's fatal error, one line
    pg/...                     torch.distributed store keys (process group rendezvous)
"""
from __future__ import annotations

import json
import threading
import time

from pyetcd import Etcd3Exception
from pyetcd.utils import prefix_range_end

from bamboo.etcd import connect


class Cluster:
    """The job's keys. Each call retries for `patience` seconds while etcd is
    unreachable (a restart, a slow disk), then raises."""

    def __init__(self, endpoint: str, job: str, patience: float = 20.0):
        self.endpoint = endpoint
        self.client = connect(endpoint)
        self.root = f"/bamboo/{job}/"
        self.patience = patience
        self._lease = None

    def _call(self, fn):
        deadline = time.monotonic() + self.patience
        while True:
            try:
                return fn()
            except (Etcd3Exception, ValueError):  # ValueError: pyetcd's endpoint marked failed
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def key(self, *parts) -> str:
        return self.root + "/".join(str(p) for p in parts)

    def put(self, value, *parts) -> None:
        self._call(lambda: self.client.put(self.key(*parts), json.dumps(value)))

    def create(self, value, *parts) -> bool:
        """Write only if absent (an etcd transaction); True when this call wrote it."""
        return bool(self._call(lambda: self.client.put_if_not_exists(self.key(*parts), json.dumps(value))))

    def create_clearing(self, value, parts: tuple, clear: list[tuple]) -> bool:
        """create(value, *parts) and, in the same transaction, delete each key in
        `clear` and every key under it: only the writer that creates the key clears."""
        tx = self.client.transactions
        key = self.key(*parts)
        deletes = [op for c in clear for op in (
            tx.delete(self.key(*c)), tx.delete(self.key(*c) + "/", range_end=prefix_range_end(f"{self.key(*c)}/".encode())))]
        ok, _ = self._call(lambda: self.client.transaction(compare=[tx.version(key) == 0],
                                                           success=[tx.put(key, json.dumps(value)), *deletes],
                                                           failure=[]))
        return bool(ok)

    def get(self, *parts):
        value, _ = self._call(lambda: self.client.get(self.key(*parts)))
        return None if value is None else json.loads(value)

    def children(self, *parts) -> dict[str, object]:
        """{last key part: value} for every key under the prefix."""
        prefix = self.key(*parts) + "/"
        return {meta.key.decode()[len(prefix):]: json.loads(value)
                for value, meta in self._call(lambda: list(self.client.get_prefix(prefix)))}

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
        """alive/<node> under a lease refreshed by a daemon thread every ttl/3.
        `on_lost()` runs if the lease expired anyway (the node was paused or cut
        off long enough for its peers to count it dead)."""
        self._lease = self.client.lease(max(1, int(round(ttl))))
        self.client.put(self.key("alive", node), str(node), lease=self._lease)

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
            alive |= {int(n) for n in self.children("members")} & set(starting)
        silent = sorted(n for n in nodes if n not in alive)
        for n in silent:
            self.create({"iteration": iteration, "by": by, "how": "lease expired"}, "failed", n)
        return silent

    def alive(self) -> set[int]:
        return {int(k) for k in self.children("alive")}

    def close(self) -> None:
        self.client.close()
