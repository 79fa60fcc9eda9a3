"""Records read from etcd are untrusted (bamboo/control/records.py): each field's
JSON value is checked against its annotation before the record is made; a
watcher's read (a read-only Cluster) leaves a malformed record out."""
import json
from dataclasses import fields

import pytest

from bamboo.control import protocol
from bamboo.control.assignment import Assignment, Restore
from bamboo.control.cluster import _records, decode
from bamboo.control.config import JobConfig
from bamboo.control.protocol import ASSIGNMENT, DONE, FAILED, Failure, Loss, Reduced, Report, job_root
from bamboo.control.records import BadRecord, fits

# (value, annotation, fits?) written out by hand: the reference the checker must agree with
TABLE = [(1, int, True), (True, int, False), (1.5, int, False), ("1", int, False), (None, int, False),
         (1, float, True), (1.5, float, True), (False, float, False), ("nan", float, False),
         ("a", str, True), (1, str, False), (True, bool, True), (1, bool, False),
         ({}, dict, True), ([], dict, False), ([], list, True), ({}, list, False),
         ([1, 2], tuple[int, ...], True), ([1, "2"], tuple[int, ...], False), ("12", tuple[int, ...], False),
         (None, dict | None, True), ({}, dict | None, True), ([], dict | None, False),
         (None, str | None, True), (3, str | None, False)]


@pytest.mark.parametrize("value,hint,expected", TABLE)
def test_fits_agrees_with_the_table(value, hint, expected):
    assert fits(value, hint) is expected


def records():
    return [getattr(protocol, n) for n in dir(protocol)
            if isinstance(getattr(protocol, n), type) and issubclass(getattr(protocol, n), protocol.Record)
            and getattr(protocol, n) is not protocol.Record]


def test_every_record_written_by_the_code_reads_back_equal():
    samples = [Loss(2.5), Failure(3, 1, "lease expired"), Reduced((1, 4)), Report(1.0, 2.0, 0, [{"a": 1}]),
               protocol.Member("a", "h", 7), protocol.ModeChoice("eager", {"rate": 0.1})]
    for record in samples:
        assert type(record).from_dict(json.loads(json.dumps(record.to_dict()))) == record
    config = JobConfig.of(stages=3, preempt=())
    assert JobConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert len(records()) > 15


@pytest.mark.parametrize("record", records(), ids=lambda r: r.__name__)
def test_a_value_of_the_wrong_type_in_any_field_is_refused_by_name(record):
    """Every field of every record: an object (a string, for a dict or list) where its value belongs is refused."""
    for f in fields(record):
        wrong = "<script>" if "dict" in str(f.type) or "list" in str(f.type) else {"<script>": 1}
        with pytest.raises(BadRecord, match=f"{record.__name__} record's {f.name} is {type(wrong).__name__}"):
            record.from_dict({f.name: wrong})


def test_no_json_object_is_a_bad_record_and_an_unknown_field_is_ignored():
    with pytest.raises(BadRecord, match="is list, not a JSON object"):
        decode(FAILED, b"[1, 2]")
    with pytest.raises(BadRecord, match="FAILED|failed"):
        decode(FAILED, b"\xff not json")
    assert decode(FAILED, json.dumps({"iteration": 1, "by": 2, "later": 3}).encode()) == Failure(1, 2)  # newer fields
    with pytest.raises(ValueError, match="assignment's restore is dict"):
        Assignment.from_dict({"epoch": 0, "start": 0, "pipelines": [[0]], "restore": {"x": 1}})
    with pytest.raises(BadRecord, match="'<b>somewhere</b>' is not a valid Restore"):
        decode(ASSIGNMENT, json.dumps({"epoch": 0, "start": 0, "pipelines": [[0]], "restore": "<b>somewhere</b>"}))
    assert decode(ASSIGNMENT, json.dumps(Assignment(0, 0, ((0,),), restore="memory").to_dict())).restore == \
        Restore.MEMORY


class Meta:
    def __init__(self, key: str):
        self.key = key.encode()


def test_a_watchers_read_leaves_a_malformed_record_out_and_a_workers_raises():
    raw = job_root("j") + DONE(3).path + "/"  # as Cluster.children reads it
    good = json.dumps(Report(1.0, 2.0, 0).to_dict()).encode()
    kvs = [(good, Meta(raw + "00000001")), (b'{"rss_mb": "<b>", "time": 1, "epoch": 0}', Meta(raw + "00000002")),
           (good, Meta(raw + "not-a-number"))]
    assert set(_records(DONE(3), raw, kvs, skip=True)) == {1}
    with pytest.raises((BadRecord, ValueError)):
        _records(DONE(3), raw, kvs)


def test_a_record_as_a_dict_is_what_dataclasses_asdict_gives_with_its_containers_copied():
    """Record.to_dict (records.plain) against the standard library's asdict, on
    records with nested lists, dicts and tuples; the result shares no container."""
    from dataclasses import asdict
    samples = [Report(1.0, 2.0, 0, [{"a": [1, 2], "b": {"c": (3, 4)}}], digests={"0": "x"}, op_ms={"F": 1.5}),
               protocol.Regroup((1, 2), True, False, {"0": {"F": 1.0}}), Reduced((1, 4)),
               protocol.ModeChoice("eager", {"rate": 0.1}), Failure(3, 1, "lease expired")]
    for record in samples:
        d = record.to_dict()
        assert d == asdict(record) and type(d) is dict
        assert json.dumps(d) == json.dumps(asdict(record))  # tuples stay tuples, in the same order
    report = samples[0]
    d = report.to_dict()
    d["events"][0]["a"].append(9)
    assert report.events[0]["a"] == [1, 2]
