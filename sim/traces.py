"""Preemption traces: when nodes join and leave, read from the formats real clouds
give, or generated from a seed.

Formats (`traces/README.md` documents them with examples):
  ec2     `milliseconds,add|remove,nodeN` per line
  gcp     `YYYY-MM-DD, HH:MM:SS, running_count` per line: a managed instance group's
          size sampled over time. Real logs repeat and reorder timestamps: samples
          are sorted by time (stable), the last sample of a repeated timestamp
          wins, and each size change becomes that many adds (new names) or removes
          (the most recently added nodes go first, as a group scales in).
  events  CSV `seconds,add|remove,node[,zone]` (a header line is allowed) or JSON:
          a list of {"time", "action", "node", "zone"?}
  zone-counts  JSON: each zone's running count every G seconds,
          {"ZONE": {"metadata": {"gap_seconds": G}, "data": [count, ...]}, ...}
Every reader raises TraceError naming the file and the line of the first bad one.
"""
from __future__ import annotations

import csv
import heapq
import json
import math
import os
import random
import tempfile
from dataclasses import dataclass
from datetime import datetime


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


# Bounds on what a trace may ask for: a span of ten years and a fleet of 100000
# nodes at once are far beyond any cloud log, and a file that asks for more (a
# running count of 10^12 would be as many events) is refused before it is built.
SPAN_MAX = 10 * 366 * 86400.0
NODES_MAX = 100_000


@dataclass(frozen=True, order=True)
class Event:
    time: float          # seconds from the start of the trace
    action: str          # "add" or "remove"
    node: str
    zone: str | None = None


def _bad(path: str, line: int, why: str) -> TraceError:
    return TraceError(f"{path}:{line}: {why}")


def _checked(events: list[Event], path: str, lines: list[int]) -> list[Event]:
    """Stable sort by time; a remove must name a node that is present."""
    order = sorted(range(len(events)), key=lambda i: events[i].time)
    present: set[str] = set()
    out = []
    for i in order:
        e = events[i]
        if e.time > SPAN_MAX:
            raise _bad(path, lines[i], f"time {e.time:g} s is beyond {SPAN_MAX:g} s (ten years)")
        if e.action == "add":
            if e.node in present:
                raise _bad(path, lines[i], f"node {e.node} added twice")
            if len(present) == NODES_MAX:
                raise _bad(path, lines[i], f"more than {NODES_MAX} nodes at once")
            present.add(e.node)
        else:
            if e.node not in present:
                raise _bad(path, lines[i], f"node {e.node} removed but not present")
            present.discard(e.node)
        out.append(e)
    return out


def read_ec2(path: str) -> list[Event]:
    events, lines = [], []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            parts = [p.strip() for p in raw.split(",")]
            if len(parts) != 3 or parts[1] not in ("add", "remove") or not parts[2]:
                raise _bad(path, n, f"expected milliseconds,add|remove,node (got {raw.strip()!r})")
            try:
                ms = int(parts[0])
            except ValueError:
                raise _bad(path, n, f"time {parts[0]!r} is not whole milliseconds") from None
            if ms < 0:
                raise _bad(path, n, "negative time")
            events.append(Event(ms / 1000, parts[1], parts[2]))
            lines.append(n)
    return _checked(events, path, lines)


def read_gcp(path: str) -> list[Event]:
    samples: list[tuple[datetime, int, int]] = []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            parts = [p.strip() for p in raw.split(",")]
            try:
                if len(parts) != 3:
                    raise ValueError
                when = datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S")
                size = int(parts[2])
                if size < 0:
                    raise ValueError
            except ValueError:
                raise _bad(path, n, f"expected YYYY-MM-DD, HH:MM:SS, running_count (got {raw.strip()!r})") from None
            if size > NODES_MAX:
                raise _bad(path, n, f"running_count {size} is more than {NODES_MAX} nodes")
            samples.append((when, n, size))
    if not samples:
        raise TraceError(f"{path}: no samples")
    samples.sort(key=lambda s: s[0])
    if (samples[-1][0] - samples[0][0]).total_seconds() > SPAN_MAX:
        raise TraceError(f"{path}: the samples span more than ten years")
    by_time: dict[datetime, int] = {}
    for when, _, size in samples:
        by_time[when] = size  # a repeated timestamp: the last sample wins
    start = min(by_time)
    events, running, counter = [], [], 0
    for when, size in by_time.items():
        t = (when - start).total_seconds()
        while len(running) < size:
            counter += 1
            running.append(f"node{counter}")
            events.append(Event(t, "add", running[-1]))
        while len(running) > size:
            events.append(Event(t, "remove", running.pop()))
    return events


def read_events(path: str) -> list[Event]:
    events, lines = [], []
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise _bad(path, e.lineno, f"invalid JSON ({e.msg})") from None
        items = [(i + 1, r) for i, r in enumerate(rows)]
        kind = "entry"
    else:
        items = [(n, r) for n, r in enumerate(csv.reader(text.splitlines()), 1) if r and any(c.strip() for c in r)]
        if items and items[0][1][0].strip().lower() in ("time", "seconds"):
            items = items[1:]  # header
        kind = "line"
    for n, r in items:
        try:
            if isinstance(r, dict):
                t, action, node, zone = float(r["time"]), r["action"], str(r["node"]), r.get("zone")
            else:
                if len(r) not in (3, 4):
                    raise ValueError
                t, action, node = float(r[0]), r[1].strip(), r[2].strip()
                zone = r[3].strip() if len(r) == 4 and r[3].strip() else None
            if action not in ("add", "remove") or not node or t < 0 or not math.isfinite(t):
                raise ValueError
        except (ValueError, KeyError, TypeError, IndexError):
            where = f"{path}: {kind} {n}" if kind == "entry" else f"{path}:{n}"
            raise TraceError(f"{where}: expected time,add|remove,node[,zone] (got {r!r})") from None
        events.append(Event(t, action, node, zone))
        lines.append(n)
    return _checked(events, path, lines)


ZONE_COUNTS_SHAPE = '{"ZONE": {"metadata": {"gap_seconds": G}, "data": [count, ...]}, ...}'
MAX_FILE_BYTES = 64 << 20
EVENTS_MAX = 10_000_000   # adds and removes a zone-count file may ask for


def read_zone_counts(path: str) -> list[Event]:
    """Each zone's running count every G seconds (the same G and length for every
    zone): a rise adds nodes named ZONE-N, a fall removes the zone's newest first."""
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise TraceError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        doc = json.loads(raw.decode())
    except json.JSONDecodeError as e:
        raise _bad(path, e.lineno, f"invalid JSON ({e.msg})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TraceError(f"{path}: not a JSON document of zone counts ({type(e).__name__})") from None
    series = _zone_series(path, doc)
    (gap,), (length,) = {g for g, _ in series.values()}, {len(d) for _, d in series.values()}
    if gap * (length - 1) > SPAN_MAX:
        raise TraceError(f"{path}: the series span more than ten years")
    if max(sum(d[i] for _, d in series.values()) for i in range(length)) > NODES_MAX:
        raise TraceError(f"{path}: more than {NODES_MAX} nodes at once")
    changes = sum(d[0] + sum(abs(b - a) for a, b in zip(d, d[1:])) for _, d in series.values())
    if changes > EVENTS_MAX:
        raise TraceError(f"{path}: the counts change by {changes} nodes in all, more than {EVENTS_MAX} events")
    events: list[Event] = []
    running: dict[str, list[str]] = {zone: [] for zone in series}
    made = dict.fromkeys(series, 0)
    for i in range(length):
        for zone, (_, data) in series.items():
            while len(running[zone]) < data[i]:
                made[zone] += 1
                running[zone].append(f"{zone}-{made[zone]}")
                events.append(Event(i * gap, "add", running[zone][-1], zone))
            while len(running[zone]) > data[i]:
                events.append(Event(i * gap, "remove", running[zone].pop(), zone))
    return events


def _zone_series(path: str, doc) -> dict[str, tuple[float, list[int]]]:
    """zone -> (gap, counts), every value checked; one gap and one length for all."""
    if not isinstance(doc, dict) or not doc:
        raise TraceError(f"{path}: expected {ZONE_COUNTS_SHAPE}")
    out = {}
    for zone, body in doc.items():
        try:
            gap, data = body["metadata"]["gap_seconds"], body["data"]
        except (KeyError, TypeError):
            raise TraceError(f"{path}: zone {zone!r}: expected {ZONE_COUNTS_SHAPE}") from None
        if not zone or len(zone) > 64 or isinstance(gap, bool) or not isinstance(gap, (int, float)) \
                or not 0 < gap < SPAN_MAX or not isinstance(data, list) or not data \
                or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= NODES_MAX for c in data):
            raise TraceError(f"{path}: zone {zone!r}: a name of 1 to 64 characters, gap_seconds a positive "
                             f"number and data a non-empty list of counts from 0 to {NODES_MAX}")
        out[zone] = (float(gap), data)
    first = next(iter(out))
    for zone, (gap, data) in out.items():
        if gap != out[first][0]:
            raise TraceError(f"{path}: zone {zone!r} has gap_seconds {gap:g}, zone {first!r} {out[first][0]:g}: "
                             "every zone's must be the same")
        if len(data) != len(out[first][1]):
            raise TraceError(f"{path}: zone {zone!r}'s series has {len(data)} counts, zone {first!r}'s "
                             f"{len(out[first][1])}: every zone's must be as long")
    return out


READERS = {"ec2": read_ec2, "gcp": read_gcp, "events": read_events, "zone-counts": read_zone_counts}


def detect(path: str) -> str:
    """The format of a trace file, from its first non-empty line."""
    with open(path) as f:
        first = next((line.strip() for line in f if line.strip()), "")
    parts = [p.strip() for p in first.split(",")]
    if first.startswith("{"):
        return "zone-counts"
    if first.startswith("[") or (parts and parts[0].lower() in ("time", "seconds")):
        return "events"
    if len(parts) == 3 and parts[1] in ("add", "remove") and parts[0].isdigit():
        return "ec2"
    if len(parts) == 3 and len(parts[0]) == 10 and parts[0][4] == "-":
        return "gcp"
    if len(parts) in (3, 4) and parts[1] in ("add", "remove"):
        return "events"
    raise TraceError(f"{path}:1: unknown trace format (expected ec2, gcp or events lines, or zone counts)")


def read(path: str, fmt: str = "auto") -> list[Event]:
    try:
        return READERS[detect(path) if fmt == "auto" else fmt](path)
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None


def synthetic(hours: float, nodes: int, zones: tuple[str, ...], rate: float, seed: int, bulk: float = 0.0,
              refill_seconds: float = 300.0, burst_refill_seconds: float | None = None) -> list[Event]:
    """A spot cluster of `nodes` spread over `zones`: each running node is
    preempted at `rate` per hour (Poisson); with probability `bulk` a preemption
    takes every node of its zone at once; the autoscaling group starts a
    replacement in the same zone after an exponential delay of mean
    `refill_seconds` (`burst_refill_seconds` after a whole zone's: its capacity
    comes back later). The same arguments give the same trace."""
    rng = random.Random(seed)
    horizon = hours * 3600
    events: list[Event] = []
    running: dict[str, str] = {}
    refills: list[tuple[float, int, str]] = []  # (time, sequence, zone)
    names = iter(f"node{i}" for i in range(10 ** 9))

    def add(t: float, zone: str) -> None:
        name = next(names)
        running[name] = zone
        events.append(Event(t, "add", name, zone))
    for i in range(nodes):
        add(0.0, zones[i % len(zones)])
    t = 0.0
    while True:
        pressure = rate * len(running) / 3600  # competing exponentials: redraw after each event
        preempt_at = t + rng.expovariate(pressure) if pressure > 0 else math.inf
        refill_at = refills[0][0] if refills else math.inf
        t = min(preempt_at, refill_at)
        if t >= horizon:
            return events
        if refill_at <= preempt_at:
            add(t, heapq.heappop(refills)[2])
            continue
        zone = running[rng.choice(sorted(running))]
        same_zone = sorted(n for n, z in running.items() if z == zone)
        burst = rng.random() < bulk
        victims = same_zone if burst else [rng.choice(same_zone)]
        wait = burst_refill_seconds if burst and burst_refill_seconds is not None else refill_seconds
        for v in victims:
            del running[v]
            events.append(Event(t, "remove", v, zone))
            delay = rng.expovariate(1 / wait) if wait > 0 else 0.0
            heapq.heappush(refills, (t + delay, len(events), zone))


def with_outages(events: list[Event], every: float, length: float, until: float | None = None) -> list[Event]:
    """`events` with the whole fleet gone for `length` seconds every `every` seconds
    (the first outage at `every`), up to `until` (default: the last event): at an
    outage's start every running node is removed at once; what the trace does
    meanwhile, its end included, is held back; once it is over the nodes the trace
    then runs come back together, in one burst, under their own names."""
    events = sorted(events, key=lambda e: e.time)
    if every <= 0 or length <= 0:
        return events
    if length >= every:
        raise ValueError(f"an outage ({length:g} s) must be shorter than the time between outages ({every:g} s)")
    out: list[Event] = []
    traced: dict[str, str | None] = {}  # node -> zone: what the trace runs
    running: set[str] = set()           # what runs here
    nxt, back = every, None             # the next outage's start; the current one's end

    def outages_before(t: float, inclusive: bool) -> None:
        """Open and close the outages that come before `t` (at `t` too: `inclusive`)."""
        nonlocal running, nxt, back
        while True:
            if back is not None and (back < t or inclusive and back <= t):
                out.extend(Event(back, "add", n, traced[n]) for n in sorted(traced))
                running, back = set(traced), None
            elif back is None and nxt <= t:
                out.extend(Event(nxt, "remove", n, traced.get(n)) for n in sorted(running))
                running, back, nxt = set(), nxt + length, nxt + every
            else:
                return
    for e in events:
        outages_before(e.time, inclusive=False)  # an event at an outage's end is held back with it
        if e.action == "add":
            traced[e.node] = e.zone
        else:
            traced.pop(e.node, None)
        if back is not None:
            continue
        if e.action == "add":
            running.add(e.node)
            out.append(e)
        elif e.node in running:
            running.discard(e.node)
            out.append(e)
    outages_before(events[-1].time if until is None and events else until or 0.0, inclusive=True)
    return out


def write_events(events: list[Event], path: str) -> None:
    """The `events` CSV format (with zones), written to a temp file and renamed."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("time,action,node,zone\n")
        for e in events:
            f.write(f"{e.time:.3f},{e.action},{e.node},{e.zone or ''}\n")
    os.replace(tmp, path)
