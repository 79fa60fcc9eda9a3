"""A flag that an etcd watch raises, for a reader that would otherwise poll a
prefix (the failover reading failed/ and abort/ between instructions, a node
lingering for finished/, the launcher waiting for reports).

A watch is lost when etcd restarts, or the member it was armed on dies (of
several): pyetcd then calls back with the error, or with None when the stream
just ended, and forgets the callback. While it is lost the flag counts as always raised (the
reader reads every time, as a poll would), and it is armed again at most once
a second; once armed the flag is raised, so whatever changed meanwhile is read.

One process asks etcd for each key range once (`SharedWatches`): a worker's
failover, linger and boundary all read failed/ and abort/, and etcd sends every
watch its own copy of each event, so three watches of a prefix would triple what
a death fans out to the job.
"""
from __future__ import annotations

import threading
import time

from pyetcd.events import PutEvent
from pyetcd.utils import prefix_range_end

REARM_SECONDS = 1.0  # how often a lost watch is asked for again
POLL_SECONDS = 0.02  # a wait's pause while the watch is lost


class Changes:
    def __init__(self, cluster, *prefixes, until=None):
        """Watch `prefixes` (protocol keys); `until`, with one prefix: only its keys
        before this one (in etcd's byte order, which zero-padded numbers keep), so that
        etcd sends no event that the reader would drop."""
        if until is not None and len(prefixes) != 1:
            raise ValueError("a watch up to a key takes one prefix")
        self.cluster, self.prefixes, self.until = cluster, prefixes, until
        self.flag = threading.Event()   # raised by the watch: something under a prefix changed
        self.lost = True                # no watch armed (never yet, or etcd dropped it)
        self._tried = 0.0               # when arming was last tried
        self.own: bytes | None = None   # the key of this reader's own latest write (see take)
        self._watches: list[Reading] = []  # what this reader reads of the process's watches (close)
        self._arm()

    def _arm(self) -> None:
        """Arm every prefix's watch; a second try at once when the first fails (the
        member asked was dead: the client has moved to another)."""
        self._tried = time.monotonic()
        for _ in range(2):
            self.close()  # a lost watch's readings, or a failed try's: each prefix is read once
            try:
                for prefix in self.prefixes:
                    self._watches.append(self._watch(prefix))
            except Exception:  # noqa: BLE001 -- etcd away: the reader reads every time until a later try
                continue
            self.lost = False
            self.flag.set()  # what changed while no watch was armed
            return

    def _watch(self, prefix) -> Reading:
        """Read one prefix's watch (up to `until`, if given), armed if no reader of this
        process has it armed."""
        key = self.cluster.key(prefix)
        if self.until is None:
            return self.cluster.watches.read(key, prefix_range_end(key.encode()).decode(), self._on_response)
        return self.cluster.watches.read(key + "/", self.cluster.key(self.until), self._on_response)

    def _on_response(self, response) -> None:
        if response is None or isinstance(response, Exception):  # the stream ended: pyetcd dropped the callback
            self.lost = True  # never closed here: this runs on pyetcd's thread (SharedWatches)
        elif not response.events:
            return  # a watch created, or etcd's progress: no key changed (arming raised the flag already)
        elif all(isinstance(e, PutEvent) and e.key == self.own for e in response.events):
            return  # the reader's own write, which it read back with the write: no news
        self.flag.set()

    def close(self) -> None:
        """No more reading: the watches go once no other reader reads them (a reader
        done early stops being woken)."""
        for reading in self._watches:
            self.cluster.watches.stop(reading)
        self._watches = []

    def take(self, own=None) -> bool:
        """Whether anything changed since the last take (always True while the
        watch is lost), lowering the flag: a change after this call raises it again.
        `own`: the key the reader writes next, reading back with it (put_and_read):
        its change raises nothing (a reader woken by its own write reads for nothing)."""
        if own is not None:
            self.own = self.cluster.key(own).encode()
        if self.lost and time.monotonic() - self._tried > REARM_SECONDS:
            self._arm()
        changed = self.flag.is_set() or self.lost
        self.flag.clear()
        return changed

    def wait(self, timeout: float) -> bool:
        """Until a change or `timeout` seconds; while the watch is lost, a poll's
        pause (at most POLL_SECONDS) and True."""
        if self.lost:
            time.sleep(min(timeout, POLL_SECONDS))
            return True
        return self.flag.wait(timeout)


class SharedWatch:
    """One armed etcd watch of a key range and the callbacks of its readers."""

    def __init__(self, key: str, end: str):
        self.key, self.end = key, end
        self.watch: int | None = None  # pyetcd's id
        self.lost = False  # its stream ended: pyetcd forgot it
        self.readers: dict[Reading, object] = {}  # replaced whole, never edited (SharedWatches)

    def deliver(self, response) -> None:
        """pyetcd's callback: the response to every reader; a loss marked first."""
        if response is None or isinstance(response, Exception):
            self.lost = True
        for callback in self.readers.values():
            callback(response)


class Reading:
    """One reader's hold on a shared watch (what `stop` takes back)."""

    def __init__(self, shared: SharedWatch):
        self.shared = shared


class SharedWatches:
    """A process's etcd watches, one per key range whatever the count of readers.

    Callbacks run on pyetcd's watch thread, which must never wait for this lock:
    a reader arming a watch holds it while that thread answers the creation. So a
    watch's readers are replaced whole rather than edited, a loss is marked before
    its readers are read, and a reader that joins as the watch is lost is told of
    the loss by `read` itself."""

    def __init__(self, client):
        self.client = client
        self._lock = threading.Lock()
        self._armed: dict[tuple[str, str], SharedWatch] = {}  # (key, range end) -> its watch

    def read(self, key: str, end: str, callback) -> Reading:
        """`callback` gets every response of the watch of keys from `key` up to `end`,
        armed now if none is (raises what pyetcd raises when etcd is away)."""
        with self._lock:
            shared = self._armed.get((key, end))
            if shared is None or shared.lost:
                shared = SharedWatch(key, end)
                shared.watch = self.client.add_watch_callback(key, shared.deliver, range_end=end)
                self._armed[(key, end)] = shared
            reading = Reading(shared)
            shared.readers = {**shared.readers, reading: callback}
        if shared.lost:  # lost as this reader joined: the loss may have read the readers before it
            callback(None)
        return reading

    def stop(self, reading: Reading) -> None:
        """The reader reads no more; the watch is cancelled once none does."""
        shared = reading.shared
        with self._lock:
            shared.readers = {r: c for r, c in shared.readers.items() if r is not reading}
            if shared.readers or shared.lost:
                return
            if self._armed.get((shared.key, shared.end)) is shared:
                del self._armed[(shared.key, shared.end)]
        try:
            self.client.cancel_watch(shared.watch)
        except Exception:  # noqa: BLE001 -- etcd away: the watch went with it
            pass
