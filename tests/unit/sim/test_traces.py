"""Trace readers on the real EC2 traces (shipped in traces/),
on hand-written GCP and generic files, on malformed input; the synthetic generator."""
import json
import os
from collections import Counter

import pytest

from sim.traces import Event, TraceError, _checked, detect, read, synthetic, with_outages, write_events

TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "traces")


def concurrent(events):
    """Running node counts after each event, by brute force over the event list."""
    counts, n = [], 0
    for e in events:
        n += 1 if e.action == "add" else -1
        counts.append(n)
    return counts


@pytest.mark.parametrize("name,lines,peak", [("ec2-p3-trace.csv", 344, 32), ("ec2-g4dn-trace.csv", 153, None)])
def test_real_ec2_traces(name, lines, peak):
    path = os.path.join(TRACES, name)
    with open(path) as f:
        raw = [line.strip().split(",") for line in f if line.strip()]
    events = read(path)
    assert detect(path) == "ec2" and len(events) == lines == len(raw)
    assert Counter(e.action for e in events) == Counter(r[1] for r in raw)
    assert [e.time for e in events] == sorted(int(r[0]) / 1000 for r in raw)
    counts = concurrent(events)
    assert min(counts) >= 0 and (peak is None or max(counts) == peak)


def test_gcp_group_sizes_become_adds_and_removes(tmp_path):
    path = tmp_path / "gcp.log"
    path.write_text("2024-03-01, 10:00:00, 3\n"
                    "2024-03-01, 10:05:00, 1\n"
                    "2024-03-01, 10:02:00, 4\n"      # out of order: sorted by time
                    "2024-03-01, 10:05:00, 2\n"      # repeated timestamp: the last sample wins
                    "\n")
    events = read(str(path))
    assert detect(str(path)) == "gcp"
    assert [(e.time, e.action, e.node) for e in events] == [
        (0, "add", "node1"), (0, "add", "node2"), (0, "add", "node3"),
        (120, "add", "node4"),
        (300, "remove", "node4"), (300, "remove", "node3")]   # newest first


def test_generic_events_csv_and_json_with_zones(tmp_path):
    csv_path = tmp_path / "e.csv"
    csv_path.write_text("time,action,node,zone\n0,add,a1,us-east-1a\n0,add,b1,us-east-1b\n12.5,remove,a1,us-east-1a\n")
    json_path = tmp_path / "e.json"
    json_path.write_text(json.dumps([{"time": 0, "action": "add", "node": "a1", "zone": "us-east-1a"},
                                     {"time": 0, "action": "add", "node": "b1", "zone": "us-east-1b"},
                                     {"time": 12.5, "action": "remove", "node": "a1", "zone": "us-east-1a"}]))
    assert read(str(csv_path)) == read(str(json_path)) == [
        Event(0, "add", "a1", "us-east-1a"), Event(0, "add", "b1", "us-east-1b"),
        Event(12.5, "remove", "a1", "us-east-1a")]


@pytest.mark.parametrize("fmt,text,where", [
    ("ec2", "0,add,node1\n5,add,node2\nfive,remove,node1\n", ":3:"),
    ("ec2", "0,add,node1\n10,remove,node9\n", ":2: node node9 removed but not present"),
    ("ec2", "0,add,node1\n0,delete,node1\n", ":2:"),
    ("gcp", "2024-03-01, 10:00:00, 3\n2024-03-01, 25:00:00, 2\n", ":2:"),
    ("gcp", "2024-03-01, 10:00:00, -1\n", ":1:"),
    ("events", "time,action,node\n0,add,x\n1,remove\n", ":3:"),
    ("gcp", "2024-03-01, 10:00:00, 3\n2024-03-01, 10:05:00, 1000000000000\n", ":2: running_count 1000000000000 is "
            "more than 100000 nodes"),
    ("ec2", "0,add,node1\n999999999999999,remove,node1\n", ":2: time 1e+12 s is beyond"),
    ("events", "time,action,node\n0,add,x\nnan,remove,x\n", ":3:"),
    ("events", "".join(f"0,add,n{i}\n" for i in range(100_001)), ":100001: more than 100000 nodes at once"),
])
def test_malformed_lines_are_named(tmp_path, fmt, text, where):
    path = tmp_path / f"bad.{fmt}"
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        read(str(path), fmt)
    assert str(path) in str(e.value) and where in str(e.value)


def test_unknown_format_and_missing_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hello world\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        read(str(path))
    with pytest.raises(TraceError, match="No such file"):
        read(str(tmp_path / "missing.csv"))


def test_synthetic_traces_repeat_and_have_the_asked_rate(tmp_path):
    a = synthetic(hours=50, nodes=8, zones=("a", "b"), rate=0.1, seed=7)
    assert a == synthetic(hours=50, nodes=8, zones=("a", "b"), rate=0.1, seed=7)
    assert a != synthetic(hours=50, nodes=8, zones=("a", "b"), rate=0.1, seed=8)
    removes = sum(e.action == "remove" for e in a)
    # about rate x node-hours (fewer nodes run while refills are pending): 40 expected
    assert 20 <= removes <= 60
    assert min(concurrent(a)) >= 0
    path = tmp_path / "s.csv"
    write_events(a, str(path))
    assert read(str(path)) == [Event(round(e.time, 3), e.action, e.node, e.zone) for e in a]


def test_bulk_preemptions_take_a_whole_zone():
    events = synthetic(hours=10, nodes=6, zones=("a", "b", "c"), rate=0.2, seed=1, bulk=1.0)
    removes = [e for e in events if e.action == "remove"]
    assert removes
    for t in {e.time for e in removes}:
        at_once = [e for e in removes if e.time == t]
        assert len({e.zone for e in at_once}) == 1
        running_in_zone = sum(1 if e.action == "add" else -1 for e in events
                              if e.time < t and e.zone == at_once[0].zone)
        assert len(at_once) == running_in_zone  # every running node of that zone


def test_outages_take_the_whole_fleet_and_bring_back_what_the_trace_then_runs():
    """Outages of 10 s every 100 s, by hand: what the trace does during one is held
    back (b's removal at the outage's very end too, so b never comes back), and the
    nodes it runs afterwards come back together when the outage ends."""
    E = Event
    trace = [E(0, "add", "a", "x"), E(0, "add", "b", "y"), E(50, "remove", "a", "x"), E(105, "add", "c", "x"),
             E(110, "remove", "b", "y"), E(150, "add", "d", "y"), E(205, "remove", "c", "x")]
    assert with_outages(trace, 100, 10, until=260) == [
        E(0, "add", "a", "x"), E(0, "add", "b", "y"), E(50, "remove", "a", "x"),
        E(100, "remove", "b", "y"),                          # the first outage takes b
        E(110, "add", "c", "x"),                             # c came meanwhile; b left at 110
        E(150, "add", "d", "y"),
        E(200, "remove", "c", "x"), E(200, "remove", "d", "y"),
        E(210, "add", "d", "y")]                             # c left during the second outage
    assert with_outages(trace, 100, 10)[-1] == E(200, "remove", "d", "y")  # ends inside the outage
    assert with_outages([], 100, 10) == [] and with_outages(trace, 0, 10) == trace
    with pytest.raises(ValueError, match="shorter than"):
        with_outages(trace, 10, 10)
    events = with_outages(synthetic(hours=10, nodes=6, zones=("a", "b"), rate=0.2, seed=2), 3600, 600, until=36000)
    read_back = _checked(events, "generated", list(range(len(events))))  # every remove names a running node
    assert read_back == events and min(concurrent(events)) == 0


def test_no_preemptions_without_a_rate():
    assert all(e.action == "add" for e in synthetic(hours=5, nodes=4, zones=("a",), rate=0.0, seed=0))
