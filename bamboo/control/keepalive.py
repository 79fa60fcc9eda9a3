"""One lease keep-alive stream per etcd client, and one thread that refreshes every
lease kept through it.

pyetcd's `refresh_lease` opens a gRPC stream, and a thread to feed it, for each
refresh, and each lease had a thread of its own; at two refreshes a second per
lease that was the largest share of an emulated fleet's CPU (commands/scale), and a
process of many leases starved some of their threads past the failure timeout.
Here a client's stream stays open; its beat thread sends, every BEAT_SECONDS, one
request for each kept lease that is due (`Kept.due`: a keeper may skip beats,
bamboo/control/liveness.py `refresh_seconds`), and its reader thread hands
each reply to its lease's keeper (`Kept.refreshed`). When the stream breaks (a
member lost, etcd restarted) pyetcd's own error handling sees the error first, so
the client fails over as for any request; the next beat opens a new stream on the
member the client uses then. A reply that does not come within the client's
timeout closes the stream the same way; meanwhile the keeper's last refresh ages,
which is what its judging of others looks at (bamboo/control/liveness.py).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Protocol

BEAT_SECONDS = 0.5  # how often the beat thread asks each kept lease whether it is due

_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pyetcd client -> its KeepAlives
_STREAMS_LOCK = threading.Lock()


def keepalives(client) -> "KeepAlives":
    """The keep-alive stream of this pyetcd client, made at its first use."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(client)
        if stream is None:
            stream = _STREAMS[client] = KeepAlives(client)
        return stream


class Kept(Protocol):
    """A lease's keeper (bamboo/control/liveness.py `Heartbeat`)."""

    def due(self) -> int | None:
        """The lease to refresh now; None: not now (stopped, or left to age on purpose)."""

    def refreshed(self, ttl: int) -> None:
        """etcd refreshed the lease: `ttl` seconds left (0 or less: it had expired)."""


class _Answer:
    """One refresh waiting for its reply: the lease's TTL left, or the error."""

    def __init__(self):
        self.done = threading.Event()
        self.ttl = 0
        self.error: BaseException | None = None


class KeepAlives:
    """The keep-alive stream of one pyetcd client (see the module's docstring)."""

    def __init__(self, client):
        self.client = client
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None  # the open stream's requests (None: no stream)
        self._call = None                               # the open stream, to cancel
        self._waiting: dict[int, _Answer] = {}          # lease ID -> a `refresh` call's wait for its reply
        self._sent: dict[int, tuple[Kept, float]] = {}  # lease ID -> its keeper, and when the beat asked
        self._kept: list[Kept] = []                     # the leases the beat refreshes
        self._beating = False

    def keep(self, kept: Kept) -> None:
        """Refresh `kept`'s lease every BEAT_SECONDS from now on, while it is due."""
        with self._lock:
            self._kept.append(kept)
            if not self._beating:
                self._beating = True
                threading.Thread(target=self._beat, daemon=True, name="lease-beat").start()

    def drop(self, kept: Kept) -> None:
        with self._lock:
            if kept in self._kept:
                self._kept.remove(kept)

    def refresh(self, lease_id: int) -> int:
        """Refresh the lease once, now; its TTL left (0 or less: it expired). Raises
        what a request to an etcd that is away raises (bamboo.control.etcd.etcd_errors)."""
        from pyetcd import etcdrpc, exceptions

        answer = _Answer()
        with self._lock:
            requests = self._stream()
            self._waiting[lease_id] = answer
        requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        if not answer.done.wait(self.client.timeout):
            self._close(requests)
            raise exceptions.ConnectionTimeoutError()
        if answer.error is not None:
            raise answer.error
        return answer.ttl

    def _beat(self) -> None:
        """Every BEAT_SECONDS: one request for each kept lease that is due, for as
        long as any lease is kept."""
        from bamboo.control.etcd import etcd_errors
        from pyetcd import etcdrpc

        while True:
            time.sleep(BEAT_SECONDS)
            with self._lock:
                kept = list(self._kept)
                if not kept:  # every lease dropped: the thread ends (keep starts another)
                    self._beating = False
                    return
            due = [(k, lease) for k in kept if (lease := k.due()) is not None]
            if not due:
                continue
            now = time.monotonic()
            try:
                with self._lock:
                    if any(now - asked > self.client.timeout for _, asked in self._sent.values()):
                        self._close_locked()  # replies stopped coming: a new stream, maybe on another member
                    requests = self._stream()
                    self._sent.update({lease: (k, now) for k, lease in due})
            except etcd_errors():  # no member to open a stream on: the next beat tries again
                continue
            for _, lease in due:
                requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease))

    def close(self) -> None:
        with self._lock:
            requests = self._requests
        if requests is not None:
            self._close(requests)

    def _stream(self) -> queue.SimpleQueue:
        """The open stream's requests, opened now if there is none (under the lock),
        with the thread that reads its replies."""
        if self._requests is not None:
            return self._requests
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = self.client.leasestub.LeaseKeepAlive(iter(requests.get, None), credentials=self.client.call_credentials,
                                                     metadata=self.client.metadata)
        self._requests, self._call = requests, call
        threading.Thread(target=self._read, args=(requests, call), daemon=True, name="lease-keepalive").start()
        return requests

    def _read(self, requests: queue.SimpleQueue, call) -> None:
        """Hand each reply to its refresh or its keeper; when the stream ends, fail
        the refreshes still waiting."""
        import grpc
        error = None  # the stream ended without one: _close says the connection failed
        try:
            for reply in call:
                with self._lock:
                    answer = self._waiting.pop(reply.ID, None)
                    kept = self._sent.pop(reply.ID, None)
                if answer is not None:
                    answer.ttl = reply.TTL
                    answer.done.set()
                if kept is not None:
                    kept[0].refreshed(reply.TTL)
        except grpc.RpcError as e:
            try:
                self.client._manage_grpc_errors(e)  # pyetcd's failover and its exception for the code
            except Exception as converted:  # noqa: BLE001 -- whatever pyetcd made of it, raised to the waiters
                error = converted
        self._close(requests, error)

    def _close(self, requests: queue.SimpleQueue, error: BaseException | None = None) -> None:
        """End this stream, if it is still the open one, and fail its waiting refreshes."""
        with self._lock:
            if self._requests is requests:
                self._close_locked(error)

    def _close_locked(self, error: BaseException | None = None) -> None:
        from pyetcd import exceptions

        requests, call, waiting = self._requests, self._call, self._waiting
        self._requests, self._call, self._waiting, self._sent = None, None, {}, {}
        if requests is None:
            return
        requests.put(None)
        call.cancel()
        for answer in waiting.values():
            answer.error = error or exceptions.ConnectionFailedError()
            answer.done.set()
