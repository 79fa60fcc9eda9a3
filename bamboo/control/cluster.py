"""The job's shared state in etcd: typed reads and writes of the protocol's keys
(bamboo/control/protocol.py names them all), and the small operations built on them."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import grpc
from pyetcd.utils import prefix_range_end

from bamboo.control.assignment import Assignment
from bamboo.control.changes import Changes, SharedWatches
from bamboo.control.etcd import FROM_ENV, EtcdError, EtcdLost, connect, retry
from bamboo.control.exits import Fenced
from bamboo.control.liveness import Heartbeat, lease_ages
from bamboo.control.protocol import ABORT, ALIVE, ASSIGNMENT, FAILED, LEASE_EXPIRED, MEMBERS, Alive, Failure, Key, job_root
from bamboo.control.records import BadRecord

AGE_SLACK = 1.5  # seconds a lease's age may be above what etcd said (it rounds to whole seconds)
SPANS_AT_ONCE = 64  # keys read one by one in a transaction (etcd allows 128 operations in one)


def _encode(key: Key, record) -> str:
    if not key.complete:
        raise ValueError(f"{key.path}: a value needs the whole key ({', '.join(key.family.params)})")
    if not isinstance(record, key.family.record):
        raise TypeError(f"{key.family.name} holds {key.family.record.__name__}, not {type(record).__name__}")
    return json.dumps(record.to_dict())


def decode(family, value: bytes):
    """The record of `family` stored as `value`; BadRecord when it is not one."""
    try:
        return family.record.from_dict(json.loads(value))
    except (ValueError, TypeError) as e:  # not JSON, not UTF-8, a field of the wrong type or name
        raise e if isinstance(e, BadRecord) else BadRecord(f"a {family.name} value: {e}") from None


def _records(prefix: Key, raw: str, kvs, skip: bool = False) -> dict:
    """{the parts below `prefix` (its raw etcd key `raw`): record} of a range read.
    `skip`: a malformed key or value is left out (a watcher's read) rather than raised."""
    family, out = prefix.family, {}
    for value, meta in kvs:
        try:
            out[family.parse(meta.key.decode()[len(raw):])] = decode(family, value)
        except ValueError:  # BadRecord, a key part that is no number, bytes that are no UTF-8
            if not skip:
                raise
    return out


class ReadOnly(RuntimeError):
    """A write through a Cluster made read-only (a bug in the reader, never etcd's)."""


def latest(assignments: dict[int, Assignment]) -> Assignment:
    """The newest epoch's assignment, of the epochs read (children(ASSIGNMENT()))."""
    if not assignments:
        raise RuntimeError("the job has no assignment in etcd")
    return assignments[max(assignments)]


def in_force(assignments: dict[int, Assignment], iteration: int) -> Assignment:
    """The assignment iteration `iteration` runs under, of the epochs read."""
    return max((a for a in assignments.values() if a.start <= iteration), key=lambda a: a.epoch)


class Cluster:
    """The job's keys. Each call retries for `patience` seconds while etcd is
    unreachable (a restart, a slow disk, a lost quorum), then raises. `endpoint`:
    HOST:PORT, or several comma-separated, the members of one etcd cluster."""

    def __init__(self, endpoint: str, job: str, patience: float = 20.0, wait: bool = False,
                 read_only: bool = False, tls=FROM_ENV):
        """`wait`: etcd may be restarting as this process starts (a worker or agent
        started mid-job): try to connect for up to `patience` seconds, not once.
        `read_only`: every write raises ReadOnly (a watcher of the job, such as the
        dashboard, must never change what the job agrees on), and a malformed
        record reads as absent (a watcher shows what it can). `tls`: as connect's."""
        self.endpoint = endpoint
        self.read_only = read_only
        self.client = self._connect(endpoint, patience if wait else 0.0, tls)
        self.watches = SharedWatches(self.client)  # one etcd watch per key range for all of `changes`' readers
        self.root = job_root(job)
        self.patience = patience
        self.heartbeat: Heartbeat | None = None      # once this process registers
        self.fenced_as: int | None = None  # the node this process writes for: its writes need it alive
        self._aged: dict[int, tuple[float, float]] = {}  # lease -> (when asked, its age)

    @staticmethod
    def _connect(endpoint: str, patience: float, tls):
        deadline = time.monotonic() + patience
        while True:
            try:
                return connect(endpoint, tls=tls)
            except EtcdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def call(self, fn):
        """fn() (an etcd request), tried again while etcd is away (or, of several
        members, the one asked is: the client moves to another), for up to
        `patience` seconds; then EtcdLost, which names etcd."""
        return retry(fn, self.patience, self.endpoint)

    def key(self, key: Key | str) -> str:
        """The raw etcd key of a protocol key (or of a store prefix from the protocol)."""
        return self.root + (key if isinstance(key, str) else key.path)

    def put(self, key: Key, record, lease=None) -> None:
        self._write([], [self.client.transactions.put(self.key(key), _encode(key, record), lease=lease)])

    def put_all(self, records: dict) -> None:
        """Write every {key: record} in one etcd transaction (one round trip, one
        disk sync, however many keys)."""
        tx = self.client.transactions
        self._write([], [tx.put(self.key(key), _encode(key, record)) for key, record in records.items()])

    def delete(self, key: Key) -> None:
        self._write([], [self.client.transactions.delete(self.key(key))])

    def create(self, key: Key, record) -> bool:
        """Write only if absent (an etcd transaction); True when this call wrote it."""
        tx = self.client.transactions
        raw = self.key(key)
        return bool(self._write([tx.version(raw) == 0], [tx.put(raw, _encode(key, record))])[0])

    def create_unless(self, key: Key, record, unless: Key) -> bool:
        """create(key, record), but only while `unless` does not exist either (one
        transaction: a late writer cannot slip in after `unless` was written)."""
        tx = self.client.transactions
        raw, value = self.key(key), _encode(key, record)
        absent = [tx.version(raw) == 0, tx.version(self.key(unless)) == 0]
        return bool(self._write(absent, [tx.put(raw, value)])[0])

    def create_clearing(self, key: Key, record, clear: list[tuple[Key, Key]]) -> bool:
        """create(key, record) and, in the same transaction, delete every key from
        `first` up to, not including, `end` (with the keys under them) for each
        (first, end) in `clear`: only the writer that creates the key clears. One
        operation a range (etcd allows 128 in a transaction, whatever the count of
        iterations cleared)."""
        tx = self.client.transactions
        raw, value = self.key(key), _encode(key, record)
        deletes = [tx.delete(self.key(first), range_end=self.key(end).encode()) for first, end in clear]
        return bool(self._write([tx.version(raw) == 0], [tx.put(raw, value), *deletes])[0])

    def _write(self, compare: list, success: list, failure: list = ()) -> tuple[bool, list]:
        """One transaction of this process's writes. Once its node is recorded dead
        (FAILED(fenced_as) exists) etcd itself refuses them, whatever this process
        believes: an old incarnation back from a partition cannot write a thing.
        Refused for that reason: Fenced."""
        if self.read_only:
            raise ReadOnly(f"a read-only reader of {self.root} tried to write")
        tx = self.client.transactions
        if self.fenced_as is None:
            return self.call(lambda: self.client.transaction(compare=compare, success=success, failure=list(failure)))
        # A failed compare is either the caller's or the guard's: the failure's own
        # read of FAILED(fenced_as) tells them apart without another round trip.
        fenced = self.key(FAILED(self.fenced_as))
        ok, responses = self.call(lambda: self.client.transaction(
            compare=[*compare, tx.version(fenced) == 0], success=success, failure=[*failure, tx.get(fenced)]))
        if ok:
            return ok, responses
        if responses[-1]:
            raise Fenced(f"etcd refused a write: {self._death(self.fenced_as, responses[-1][0][0])}")
        return ok, responses[:-1]

    def get(self, key: Key):
        """The record at `key`, or None."""
        value, _ = self.call(lambda: self.client.get(self.key(key)))
        if value is None:
            return None
        try:
            return decode(key.family, value)
        except BadRecord:
            if not self.read_only:
                raise
            return None  # a watcher reads a malformed record as none

    def children(self, prefix: Key) -> dict:
        """{the parts below the prefix (an int, or a tuple): record} for every key under it."""
        raw = self.key(prefix) + "/"
        return _records(prefix, raw, self.call(lambda: list(self.client.get_prefix(raw))), self.read_only)

    def changed_since(self, prefix: Key, revision: int) -> tuple[dict, int]:
        """children(prefix) of the keys written after etcd revision `revision` (0: all),
        and the revision read at: a reader that keeps what it read asks for what is new."""
        raw = self.key(prefix) + "/"
        response = self.call(lambda: self.client.get_prefix_response(raw, min_mod_revision=revision + 1))
        kvs = [(kv.value, kv) for kv in response.kvs]
        return _records(prefix, raw, kvs, self.read_only), response.header.revision

    def edge(self, prefix: Key, last: bool = False):
        """The parts of the first key under `prefix` (of the last, if `last`) in etcd's
        order, which is the numbers' order; None if there is none."""
        found = self.firsts(prefix, 1, last)
        return found[0] if found else None

    def firsts(self, prefix: Key, count: int, last: bool = False) -> list:
        """The parts of the first `count` keys under `prefix` (the last ones, newest
        first, if `last`): their names are read, not the family's records. A key
        that is no number is left out."""
        raw = self.key(prefix) + "/"
        order = "descend" if last else "ascend"
        found = self.call(lambda: list(self.client.get_prefix(raw, limit=count, keys_only=True, sort_order=order)))
        out = []
        for _, meta in found:
            try:
                out.append(prefix.family.parse(meta.key.decode()[len(raw):]))
            except ValueError:
                continue
        return out

    def put_and_read(self, key: Key, record, *prefixes: Key, also: dict | None = None) -> list[dict]:
        """put(key, record) and every {key: record} of `also`, then children(prefix)
        of each of `prefixes`, in one etcd transaction: one round trip, and the
        reads see the writes."""
        tx = self.client.transactions
        puts = [tx.put(self.key(k), _encode(k, r)) for k, r in {key: record, **(also or {})}.items()]
        return self._read(puts, prefixes)

    def read(self, *prefixes: Key) -> list[dict]:
        """children(prefix) of each of `prefixes`, in one transaction (one view of etcd)."""
        return self._read([], prefixes)

    def read_spans(self, *spans: tuple[Key, Key | None]) -> list[dict]:
        """For each (first, end), the keys of first's family from `first` up to, not
        including, `end` (None: to the family's last), with their parts below the
        family, all in one transaction: (DONE(12), DONE(20)) gives {(it, node):
        report} of iterations 12 to 19, (FAILED(), None) every failure. A reader
        that keeps what it read asks only for what is new, a bounded piece at a time."""
        return self._ranges([], [self._span_range(first, end) for first, end in spans])

    def read_with_aborts(self, iterations: range, *prefixes: Key) -> tuple:
        """The abort records of `iterations` ({iteration: Abort}), then children(prefix)
        of each of `prefixes`, in one transaction: a waiting node's look is one request."""
        return tuple(self._ranges([], [self._span_range(ABORT(iterations.start), ABORT(iterations.stop)),
                                       *map(self._children_range, prefixes)]))

    def _span_range(self, first: Key, end: Key | None) -> tuple:
        """read_spans' (first, end) as a range for _ranges."""
        raw = self.key(first.family()) + "/"
        return (first.family(), raw, self.key(first) if first.parts else raw,
                prefix_range_end(raw.encode()) if end is None else self.key(end).encode())

    def _read(self, puts: list, prefixes) -> list[dict]:
        return self._ranges(puts, list(map(self._children_range, prefixes)))

    def _children_range(self, prefix: Key) -> tuple:
        """(prefix, its raw key, where its children start, where they end) for _ranges."""
        raw = self.key(prefix) + "/"
        return prefix, raw, raw, prefix_range_end(raw.encode())

    def _ranges(self, puts: list, ranges: list) -> list[dict]:
        """The puts, then the records of each (prefix, its raw key, the raw key to
        start at, the raw key to end before), all in one transaction."""
        tx = self.client.transactions
        gets = [tx.get(start, end) for _, _, start, end in ranges]
        _, responses = self._write([], puts + gets) if puts else \
            self.call(lambda: self.client.transaction(compare=[], success=gets, failure=[]))
        return [_records(prefix, raw, kvs, self.read_only)
                for (prefix, raw, _, _), kvs in zip(ranges, responses[len(puts):])]

    def create_or_get(self, key: Key, record, also: dict | None = None) -> tuple[object, bool]:
        """create(key, record), or else read what is there, in one transaction: the
        record that stands at `key`, and whether this call wrote it. Every {key:
        record} of `also` is written either way (with it; or, when another wrote
        `key` first, in a transaction of its own)."""
        tx = self.client.transactions
        raw, value = self.key(key), _encode(key, record)
        puts = [tx.put(self.key(k), _encode(k, r)) for k, r in (also or {}).items()]
        wrote, responses = self._write([tx.version(raw) == 0], [tx.put(raw, value), *puts], [tx.get(raw)])
        if wrote:
            return record, True
        if also:
            self.put_all(also)
        (stored, _), = responses[0]
        return decode(key.family, stored), False

    def wait_for(self, predicate, timeout: float, what: str, poll: float = 0.02, changes: Changes | None = None):
        """Poll until predicate() returns something truthy; TimeoutError naming `what`.
        With `changes` (a watch of what the predicate reads) it is asked again when
        the watch says something changed, and at the latest after `poll` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if changes is not None:
                changes.take()  # lowered before the read: a change after it ends the wait below
            result = predicate()
            self.progress()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            if changes is not None:
                changes.wait(poll)
            else:
                time.sleep(poll)

    def register(self, node: int, cfg, on_fenced) -> None:
        """ALIVE(node) under a lease this process keeps refreshing (bamboo/control/liveness.py);
        `on_fenced(reason)` runs if it expired while the node was recorded dead."""
        self.fenced_as = node
        f = cfg.faults
        self.heartbeat = Heartbeat(self, ALIVE(node), lambda lease: Alive(node, lease), f.lease_ttl,
                                   f.failure_timeout, f.hang_timeout, lambda: self.death_of(node), on_fenced)

    def death_of(self, node: int) -> str | None:
        """Why `node` is dead, as a fenced node says it (None while it is not)."""
        value, _ = self.call(lambda: self.client.get(self.key(FAILED(node))))
        return None if value is None else self._death(node, value)

    @staticmethod
    def _death(node: int, stored: bytes) -> str:
        failure = decode(FAILED, stored)
        return f"node {node} was recorded dead in iteration {failure.iteration} by node {failure.by} ({failure.how})"

    def progress(self) -> None:
        """The calling (main) thread is not stuck: see Heartbeat.progress."""
        if self.heartbeat:
            self.heartbeat.progress()

    def hang_deadline(self, seconds: float) -> None:
        """From now on, a main thread stuck this long lets the lease lapse."""
        if self.heartbeat:
            self.heartbeat.hang_timeout = seconds

    def silent(self, nodes, starting=()) -> list[int]:
        """Those of `nodes` that went silent: their key is gone, or (judged only when
        this node's own view of etcd is fresh) their lease was not refreshed for
        the failure timeout. Nodes in `starting` (their worker may not run yet)
        count as alive while their agent is."""
        nodes, starting = list(nodes), set(starting)
        workers, agents = self._liveness(nodes, [n for n in nodes if n in starting])
        records = {**{n: m for n, m in agents.items() if n not in workers}, **workers}  # a worker counts once it is
        silent = {n for n in nodes if n not in records}
        if self.heartbeat and self.heartbeat.judging():
            silent |= set(self._stale({n: records[n].lease for n in nodes if n in records and records[n].lease}))
        return sorted(silent)

    def _liveness(self, nodes: list[int], starting: list[int]) -> tuple[dict, dict]:
        """The ALIVE records of `nodes` and the MEMBERS records of `starting`: key by
        key in one transaction when they are few (a pipeline's peers: what the job's
        size does not change), else both families whole."""
        if len(nodes) + len(starting) > SPANS_AT_ONCE:
            members = self.children(MEMBERS()) if starting else {}
            return self.children(ALIVE()), {n: m for n, m in members.items() if n in starting}
        if not nodes:
            return {}, {}
        found = self.read_spans(*((ALIVE(n), ALIVE(n + 1)) for n in nodes),
                                *((MEMBERS(n), MEMBERS(n + 1)) for n in starting))
        workers, agents = found[:len(nodes)], found[len(nodes):]
        return ({n: r for span in workers for n, r in span.items()},
                {n: r for span in agents for n, r in span.items()})

    def _stale(self, leases: dict[int, int]) -> list[int]:
        """Nodes whose lease was not refreshed for the failure timeout. A lease is
        asked at most every 0.25 s, and only once it may be that old: an age read at
        t grows by at most the seconds since t (plus etcd's rounding to whole
        seconds), so a peer seen fresh is not asked again for about the timeout.
        Every waiting node asking every peer twice a second was most of a loaded
        job's requests."""
        now, timeout = time.monotonic(), self.heartbeat.failure_timeout
        asked = {}
        for n, lease in leases.items():
            when, age = self._aged.get(lease, (float("-inf"), 0.0))
            if now - when > 0.25 and age + (now - when) + AGE_SLACK > timeout:
                asked[n] = lease
        for n, age in lease_ages(self, asked).items():
            self._aged[asked[n]] = (now, age)
        return [n for n, lease in leases.items()
                if lease in self._aged and self._aged[lease][1] > timeout]

    def record_silent(self, nodes, iteration: int, by: int, starting=()) -> list[int]:
        """Record as dead each of `nodes` that went silent (see `silent`); return them."""
        silent = self.silent(nodes, starting)
        for n in silent:
            self.record_dead(n, Failure(iteration, by, LEASE_EXPIRED))
        return silent

    def record_dead(self, node: int, failure: Failure) -> bool:
        """FAILED(node) (first detector wins: True when this call wrote it), then the
        node's leases revoked: its keys go now, so nothing in a recovery waits out
        their TTL, and should the node come back its heartbeat finds its lease
        gone and stops it, saying why."""
        wrote = self.create(FAILED(node), failure if failure.time else replace(failure, time=time.time()))
        for record in (self.get(ALIVE(node)), self.get(MEMBERS(node))):
            if record is not None and record.lease:
                self._revoke(record.lease)
        return wrote

    def _revoke(self, lease: int) -> None:
        """Revoke `lease`, retried while etcd is away (a leader change); a lease
        that is gone already (expired, or revoked by another detector) is done."""
        def revoke():
            try:
                self.client.revoke_lease(lease)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        try:
            self.call(revoke)
        except EtcdLost:
            pass  # etcd away for the whole patience: the lease expires on its own

    def alive(self) -> set[int]:
        return set(self.children(ALIVE()))

    def failed(self) -> dict[int, Failure]:
        return self.children(FAILED())

    # -- configuration epochs -----------------------------------------------------------
    def assignments(self) -> dict[int, Assignment]:
        return self.children(ASSIGNMENT())

    def latest_assignment(self) -> Assignment:
        """The newest epoch's assignment, read alone: every epoch's (each names every
        member) read by every waiting node at every poll grew as N x N x epochs."""
        found = self.newest(ASSIGNMENT())
        if found is None:
            raise RuntimeError("the job has no assignment in etcd")
        return found[1]

    def newest(self, prefix: Key) -> tuple | None:
        """(parts, record) of the last key under `prefix` whose name is a number (the
        newest epoch, say), in one read of that one record; None if there is none."""
        raw = self.key(prefix) + "/"
        found = self.call(lambda: list(self.client.get_range(raw, raw + ":", limit=1, sort_order="descend")))
        return next(iter(_records(prefix, raw, found, self.read_only).items()), None)

    def assignment_at(self, iteration: int) -> Assignment:
        return in_force(self.assignments(), iteration)

    def changes(self, *prefixes: Key, until: Key | None = None) -> Changes:
        """A flag raised whenever a key under one of `prefixes` (with `until`, one
        prefix's keys before it) is written or deleted (an etcd watch), for a reader
        that would otherwise poll: bamboo/control/changes.py."""
        return Changes(self, *prefixes, until=until)

    def close(self) -> None:
        self.client.close()
