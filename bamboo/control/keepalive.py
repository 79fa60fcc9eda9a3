"""One lease keep-alive stream per etcd client, for every lease kept through it.

pyetcd's `refresh_lease` opens a gRPC stream, and a thread to feed it, for each
refresh; at two refreshes a second per lease that churn was the largest share of
an emulated fleet's CPU (commands/scale). Here a client's stream stays open and a
refresh is one request on it, answered by the lease's ID. When the stream breaks
(a member lost, etcd restarted) pyetcd's own error handling sees the error first,
so the client fails over as for any request, the refreshes waiting on it raise,
and the next refresh opens a new stream on the member the client uses then. A
refresh unanswered within the client's timeout closes the stream the same way.
"""
from __future__ import annotations

import queue
import threading
import weakref

_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pyetcd client -> its KeepAlives
_STREAMS_LOCK = threading.Lock()


def keepalives(client) -> "KeepAlives":
    """The keep-alive stream of this pyetcd client, made at its first use."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(client)
        if stream is None:
            stream = _STREAMS[client] = KeepAlives(client)
        return stream


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
        self._waiting: dict[int, _Answer] = {}          # lease ID -> its refresh in flight

    def refresh(self, lease_id: int) -> int:
        """Refresh the lease; its TTL left (0 or less: it expired). Raises what a
        request to an etcd that is away raises (bamboo.control.etcd.etcd_errors)."""
        from pyetcd import etcdrpc, exceptions

        answer = _Answer()
        with self._lock:
            requests = self._requests if self._requests is not None else self._open()
            self._waiting[lease_id] = answer
        requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        if not answer.done.wait(self.client.timeout):
            self._close(requests)
            raise exceptions.ConnectionTimeoutError()
        if answer.error is not None:
            raise answer.error
        return answer.ttl

    def close(self) -> None:
        with self._lock:
            requests = self._requests
        if requests is not None:
            self._close(requests)

    def _open(self) -> queue.SimpleQueue:
        """A new stream (under the lock), with the thread that reads its replies."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        call = self.client.leasestub.LeaseKeepAlive(iter(requests.get, None), credentials=self.client.call_credentials,
                                                     metadata=self.client.metadata)
        self._requests, self._call = requests, call
        threading.Thread(target=self._read, args=(requests, call), daemon=True, name="lease-keepalive").start()
        return requests

    def _read(self, requests: queue.SimpleQueue, call) -> None:
        """Hand each reply to its refresh; when the stream ends, fail the rest."""
        import grpc
        error = None  # the stream ended without one: _close says the connection failed
        try:
            for reply in call:
                with self._lock:
                    answer = self._waiting.pop(reply.ID, None)
                if answer is not None:
                    answer.ttl = reply.TTL
                    answer.done.set()
        except grpc.RpcError as e:
            try:
                self.client._manage_grpc_errors(e)  # pyetcd's failover and its exception for the code
            except Exception as converted:  # noqa: BLE001 -- whatever pyetcd made of it, raised to the waiters
                error = converted
        self._close(requests, error)

    def _close(self, requests: queue.SimpleQueue, error: BaseException | None = None) -> None:
        """End this stream, if it is still the open one, and fail its waiting refreshes."""
        from pyetcd import exceptions

        with self._lock:
            if self._requests is not requests:
                return
            call, waiting = self._call, self._waiting
            self._requests, self._call, self._waiting = None, None, {}
        requests.put(None)
        call.cancel()
        for answer in waiting.values():
            answer.error = error or exceptions.ConnectionFailedError()
            answer.done.set()
