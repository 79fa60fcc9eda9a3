"""A flag that an etcd watch raises, for a reader that would otherwise poll a
prefix (the failover reading failed/ and abort/ between instructions, a node
lingering for finished/, the launcher waiting for reports).

A watch is lost when etcd restarts, or the member it was armed on dies (of
several): pyetcd then calls back with the error, or with None when the stream
just ended, and forgets the callback. While it is lost the flag counts as always raised (the
reader reads every time, as a poll would), and it is armed again at most once
a second; once armed the flag is raised, so whatever changed meanwhile is read.
"""
from __future__ import annotations

import threading
import time

from pyetcd.events import PutEvent

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
        self._watches: list = []        # pyetcd's ids of the armed watches (close)
        self._arm()

    def _arm(self) -> None:
        """Arm every prefix's watch; a second try at once when the first fails (the
        member asked was dead: the client has moved to another)."""
        self._tried = time.monotonic()
        for _ in range(2):
            try:
                for prefix in self.prefixes:
                    self._watches.append(self._watch(prefix))
            except Exception:  # noqa: BLE001 -- etcd away: the reader reads every time until a later try
                self.close()  # the ones armed in this try, so that the next try arms each prefix once
                continue
            self.lost = False
            self.flag.set()  # what changed while no watch was armed
            return

    def _watch(self, prefix) -> int:
        """Arm one prefix's watch (up to `until`, if given); pyetcd's id of it."""
        client, key = self.cluster.client, self.cluster.key(prefix)
        if self.until is None:
            return client.add_watch_prefix_callback(key, self._on_response)
        return client.add_watch_callback(key + "/", self._on_response, range_end=self.cluster.key(self.until))

    def _on_response(self, response) -> None:
        if response is None or isinstance(response, Exception):  # the stream ended: pyetcd dropped the callback
            self.lost = True
            self._watches = []  # their ids died with the stream
        elif not response.events:
            return  # a watch created, or etcd's progress: no key changed (arming raised the flag already)
        elif all(isinstance(e, PutEvent) and e.key == self.own for e in response.events):
            return  # the reader's own write, which it read back with the write: no news
        self.flag.set()

    def close(self) -> None:
        """No more reading: the watches go (a reader done early stops being woken)."""
        for watch in self._watches:
            try:
                self.cluster.client.cancel_watch(watch)
            except Exception:  # noqa: BLE001 -- etcd away: the watch went with it
                pass
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
