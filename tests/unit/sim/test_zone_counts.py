"""Zone-count traces: each zone's running count every G seconds, read into events
whose replay gives back every count of every zone; bad files are one line."""
import json
import random

import pytest

from sim import command
from sim.traces import TraceError, read


def replayed(events, zones, gap: float, length: int) -> dict[str, list[int]]:
    """Each zone's count at every sample time, counted from the events alone."""
    live: dict[str, str] = {}
    out = {z: [] for z in zones}
    pending = sorted(events, key=lambda e: e.time)
    for i in range(length):
        while pending and pending[0].time <= i * gap:
            e = pending.pop(0)
            if e.action == "add":
                live[e.node] = e.zone
            else:
                del live[e.node]
        for z in zones:
            out[z].append(sum(zone == z for zone in live.values()))
    return out


def test_the_events_give_back_every_zone_s_counts(tmp_path):
    rng = random.Random(4)
    series = {z: [rng.randint(0, 6) for _ in range(50)] for z in ("us-east-1a", "us-east-1b", "us-east-1c")}
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({z: {"metadata": {"gap_seconds": 60}, "data": d} for z, d in series.items()}))
    events = read(str(path))  # detected from its first character
    assert replayed(events, series, 60.0, 50) == series
    assert all(e.node.startswith(e.zone + "-") for e in events)


@pytest.mark.parametrize("doc,says", [
    ({"a": {"metadata": {"gap_seconds": 60}, "data": [1, 2]}, "b": {"metadata": {"gap_seconds": 60}, "data": [1]}},
     "zone 'b''s series has 1 counts, zone 'a''s 2: every zone's must be as long"),
    ({"a": {"metadata": {"gap_seconds": 60}, "data": [1]}, "b": {"metadata": {"gap_seconds": 30}, "data": [1]}},
     "every zone's must be the same"),
    ({"a": {"metadata": {"gap_seconds": -1}, "data": [1]}}, "gap_seconds a positive number"),
    ({"a": {"metadata": {"gap_seconds": 60}, "data": [1, -2]}}, "counts from 0"),
    ({"a": {"data": [1]}}, "expected {\"ZONE\""),
    ([], None),
    ({"a": {"metadata": {"gap_seconds": 1}, "data": [100_000, 0] * 60}}, "more than 10000000 events"),
])
def test_a_bad_zone_count_file_is_one_line(tmp_path, capsys, doc, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    if doc == []:
        with pytest.raises(TraceError):
            read(str(path), "zone-counts")
        return
    assert command.main(["--trace", str(path), "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_a_file_that_is_not_json_text_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("{" + '"a":' * 1 + "[" * 100_000 + "]" * 100_000 + "}")
    assert command.main(["--trace", str(path), "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and err.count("\n") == 1, err
