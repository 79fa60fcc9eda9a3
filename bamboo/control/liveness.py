"""How a node stays alive in etcd, and how its peers tell that it went silent.

A node's key (ALIVE for a worker, MEMBERS for an agent) lives under a lease that
its etcd client's one keep-alive thread and stream refresh six times in a failure
timeout: twice a second at the default 3 s, less often where a job waits longer
to call a node dead (`refresh_seconds`; bamboo/control/keepalive.py). Two clocks
matter, kept apart:

  - the lease's TTL (--lease-ttl, 15 s) is how long etcd may be unreachable
    (stalled, restarting) before keys vanish: long, so a stall fences nobody;
  - a lease's age (seconds since its last refresh, which any client can ask
    etcd, rounded up to whole seconds) tells silence: a peer whose lease is
    older than --failure-timeout
    stopped refreshing (SIGSTOP, a hang, a machine gone) and is dead. Only an
    observer that itself kept refreshing without a gap for that long judges, so
    a stall of etcd, or of the observer, condemns no one.

A worker whose main thread makes no progress for its hang deadline (a collective
that never returns) stops refreshing on purpose: its peers then see it silent.
The deadline follows the job's pace: HANG_FACTOR times the running median of its
recent iterations, never under HANG_FLOOR, never over --hang-timeout (which is
also gloo's operation timeout, and the deadline before any iteration ended).
A lease that expired anyway (etcd was away longer than the TTL) is taken again,
unless the node was recorded dead meanwhile: then it stops, saying why. Recording
a node dead revokes its leases (Cluster.record_dead), so a node that comes back
from a partition finds its lease gone at its next refresh, and etcd refuses the
new key (the write is guarded on FAILED(node) being absent): it never registers
again under its identity.
"""
from __future__ import annotations

import sys
import threading
import time

from bamboo.control.etcd import EtcdLost, etcd_errors
from bamboo.control.exits import Fenced
from bamboo.control.keepalive import BEAT_SECONDS, keepalives

REFRESHES_PER_TIMEOUT = 6  # a lease is refreshed this often in a failure timeout (the default: every beat)
HANG_FACTOR = 10      # a main thread stuck this many median iterations is hung ...
HANG_FLOOR = 60.0     # ... but never sooner: a handover or a restore blocks longer than an iteration
HANG_WINDOW = 20      # recent iterations the median is taken over


def refresh_seconds(failure_timeout: float, ttl: float) -> float:
    """How often a node refreshes its lease: REFRESHES_PER_TIMEOUT times in a failure
    timeout, so that a live node's lease (its age counted in whole seconds) never
    looks that old, and at least three times in its TTL; in whole beats of its
    client's keep-alive thread, one at least (every 0.5 s at the default 3 s). A job
    that waits longer to call a node dead asks etcd proportionally less."""
    beats = int(min(failure_timeout / REFRESHES_PER_TIMEOUT, ttl / 3) / BEAT_SECONDS)
    return max(1, beats) * BEAT_SECONDS


def hang_deadline(iteration_seconds: list[float], cap: float) -> float:
    """The hang deadline after these iterations: see the module's docstring."""
    recent = sorted(iteration_seconds[-HANG_WINDOW:])
    if not recent:
        return cap
    return min(cap, max(HANG_FLOOR, HANG_FACTOR * recent[len(recent) // 2]))


class Heartbeat:
    """Keeps `key` (a protocol key) with `record` under a lease of `ttl` seconds.
    `fenced()` returns a reason when the node must not come back (it was recorded
    dead) and `on_fenced(reason)` stops it."""

    def __init__(self, cluster, key, record, ttl: float, failure_timeout: float,
                 hang_timeout: float | None = None, fenced=lambda: None, on_fenced=None):
        self.cluster, self.key, self.record = cluster, key, record
        self.ttl, self.failure_timeout, self.hang_timeout = max(2, int(round(ttl))), failure_timeout, hang_timeout
        self.fenced, self.on_fenced = fenced, on_fenced
        self.lease = None
        self.refresh = refresh_seconds(failure_timeout, self.ttl)  # seconds between refreshes
        self.gap = 2 * self.refresh + 0.5  # refreshes further apart than this: this node's view was stale
        self.last_refresh = self.fresh_since = time.monotonic()  # of this node's own lease
        self.last_progress = time.monotonic()                     # stamped by the main thread
        self._stop = threading.Event()
        self._hung_said = False   # the hang was said (once)
        self._expiring = False    # a thread takes the lease again (or stops the node)
        self._take_lease()
        keepalives(cluster.client).keep(self)  # its client's one thread and stream refresh it from now on

    def _take_lease(self) -> None:
        lease = self.cluster.client.lease(self.ttl)
        try:
            self.cluster.put(self.key, self.record(lease.id), lease=lease)
        except Fenced:
            lease.revoke()  # etcd refused the key (the node is recorded dead): no lease left behind
            raise
        self.lease = lease

    def progress(self) -> None:
        """The main thread is not stuck (called from its wait loops and steps)."""
        self.last_progress = time.monotonic()

    def judging(self) -> bool:
        """Whether this node's own view of etcd is fresh enough to call others silent."""
        now = time.monotonic()
        return now - self.last_refresh < self.gap and now - self.fresh_since > self.failure_timeout + 2 * self.refresh

    def halt(self) -> None:
        """Stop refreshing, the lease left to age as a machine gone leaves it (the
        scale harness's deaths: commands/scale/emulator.py)."""
        self._stop.set()
        keepalives(self.cluster.client).drop(self)

    def stop(self) -> None:
        self.halt()
        try:
            self.lease.revoke()
        except etcd_errors():  # etcd gone, or the lease revoked already
            pass

    def due(self) -> int | None:
        """The lease to refresh now (keepalive.Kept): from a beat before `refresh`
        seconds have passed since etcd's last reply (so at every beat by default), and
        at every beat until the next reply comes (a request lost with its stream is
        asked again at the next); None sooner, once stopped, and while the
        main thread is stuck past its hang deadline: the lease then ages, and peers
        find this node silent."""
        now = time.monotonic()
        if self._stop.is_set() or self._expiring or now - self.last_refresh < self.refresh - BEAT_SECONDS:
            return None
        if self.hang_timeout and now - self.last_progress > self.hang_timeout:
            if not self._hung_said:
                print(f"bamboo: no progress for {self.hang_timeout:.0f} s (the hang deadline): "
                      "this node stops refreshing its lease and will be counted dead", file=sys.stderr, flush=True)
            self._hung_said = True
            return None
        return self.lease.id

    def refreshed(self, ttl: int) -> None:
        """etcd refreshed the lease (keepalive.Kept): a gap since the last refresh
        means this node's view was stale until now; an expired lease is taken again
        on a thread of its own (it writes to etcd). A stopped heartbeat hears nothing."""
        if self._stop.is_set():
            return
        now = time.monotonic()
        if now - self.last_refresh > self.gap:
            self.fresh_since = now
        self.last_refresh = now
        if ttl <= 0 and not self._expiring:
            self._expiring = True
            threading.Thread(target=self._expired, daemon=True, name="lease-expired").start()

    def _expired(self) -> None:
        """The lease ran out (etcd was unreachable longer than its TTL)."""
        try:
            reason = self.fenced()
            if reason is None:
                self._take_lease()  # refused by etcd (Fenced) once the node is recorded dead
                print(f"bamboo: lease expired while etcd was unreachable; registered again as {self.key.path}",
                      file=sys.stderr, flush=True)
        except Fenced as e:
            reason = str(e)
        except (*etcd_errors(), EtcdLost):
            return  # etcd away again: the next refresh's reply says so again
        finally:
            self._expiring = False
        if reason is not None:
            self.halt()  # the lease is gone for good: nothing more to refresh, the node is told once
            if self.on_fenced:
                self.on_fenced(reason)


def lease_ages(cluster, leases: dict[int, int]) -> dict[int, float]:
    """node -> seconds since its lease was last refreshed (etcd counts whole
    seconds), infinite for a lease that is gone; nodes etcd did not answer for
    are left out."""
    ages = {}
    for node, lease in leases.items():
        try:
            info = cluster.client.get_lease_info(lease)
        except etcd_errors():
            continue
        ages[node] = info.grantedTTL - info.TTL if info.TTL > 0 else float("inf")
    return ages
