"""The control-plane protocol: every key family's record survives JSON and a real
etcd, raw keys parse back to what made them, and no module but bamboo/control/protocol.py
spells a key."""
import ast
import json
import pathlib

import pytest

from bamboo.control import protocol as p
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = {
    p.CONFIG: JobConfig.of(stages=4, microbatches=8), p.START: p.Start(3),
    p.ASSIGNMENT: Assignment(2, 5, ((0, 1), (2, 3)), (4,), (5,), (5, 6), "peers", True, 1, "lazy"),
    p.ALIVE: p.Alive(1, 7), p.FAILED: p.Failure(4, 2, "lease expired"), p.CUT: p.Cut({"send_act": 3}),
    p.FINISHED: p.Finished(p.Report(280.0, 1.25, 2, busy=0.5).to_dict()), p.LOSS: p.Loss(5.5), p.VAL_LOSS: p.Loss(4.5),
    p.DONE: p.Report(300.5, 1.5, 2, [{"type": "failover"}], digests={"0": "ab"}),
    p.ABORT: p.Abort("two died", 3), p.ABORTED: p.Mark(), p.REGROUP: p.Regroup((1, 5), True, False),
    p.HANDED: p.Mark(), p.HANDOVER: p.Outcome(False, "node 3 died"), p.REDUCED: p.Reduced((0, 4)),
    p.LOAN: p.Loan(2, "kept"), p.LENT: p.Lent(2, "reduced", False),
    p.TIED: p.Reduced((0, 3)), p.NORM: p.Loss(2.5),
    p.SCALE: p.LossScale(32768.0, 7, True), p.MODE: p.ModeChoice("lazy", {"deaths": 1.5, "seconds": {"off": 0.2}}),
    p.CHECKPOINTED: p.Timestamp(12.5), p.COMPLETED: p.Timestamp(13.5), p.PREEMPTED: p.Preempted(2, 9.0),
    p.ERROR: p.WorkerError("TimeoutError: x"), p.IDS: p.Mark(), p.MEMBERS: p.Member("a", "host", 9),
    p.ZONES: p.Zone("b", "", 5.0), p.DRAIN: p.Timestamp(1.0), p.LEFT: p.Timestamp(3.0),
    p.NOTICES: p.Notice("ec2", 2.0, "terminate"),
    p.RELEASES: p.Release((6, 7), 1, 7, 8, 1000.0),
    p.COPIES: p.Copies(6, (2, 3), {"scale": 1024.0, "good": 3, "overflow": False}),
}


def test_every_family_has_an_example_and_records_survive_json():
    assert set(EXAMPLES) == set(p.FAMILIES)
    for family, record in EXAMPLES.items():
        assert isinstance(record, family.record)
        assert family.record.from_dict(json.loads(json.dumps(record.to_dict()))) == record, family.name


def test_raw_keys_parse_back():
    for family in p.FAMILIES:
        parts = tuple(range(7, 7 + len(family.params)))
        raw = p.job_root("j1") + family(*parts).path
        expected = () if not parts else parts[0] if len(parts) == 1 else parts
        assert p.parse(raw) == ("j1", family, expected)
    assert p.parse("/elsewhere/x") is None and p.job_of("/bamboo/j2/done/1/2") == "j2"


def test_bad_keys_and_values_are_refused(etcd):
    cluster = Cluster(etcd.endpoint, "j")
    with pytest.raises(TypeError, match="at most 2"):
        p.DONE(1, 2, 3)
    with pytest.raises(ValueError, match="whole key"):
        cluster.put(p.DONE(1), p.Report(1.0, 1.0, 0))
    with pytest.raises(TypeError, match="holds Loss"):
        cluster.put(p.LOSS(1, 2), p.Timestamp(1.0))


def test_records_round_trip_through_etcd_and_children_parse_their_parts(etcd):
    cluster = Cluster(etcd.endpoint, "j")
    for family, record in EXAMPLES.items():
        key = family(*range(1, 1 + len(family.params)))
        cluster.put(key, record)
        assert cluster.get(key) == record, family.name
    cluster.put(p.DONE(1, 7), EXAMPLES[p.DONE])
    assert set(cluster.children(p.DONE(1))) == {2, 7}
    assert set(cluster.children(p.DONE())) == {(1, 2), (1, 7)}
    found = {(family, parts) for job, family, parts in p.scan(cluster.client) if job == "j"}
    assert (p.DONE, (1, 7)) in found and (p.CONFIG, ()) in found


KEY_METHODS = {"put", "get", "create", "create_clearing", "children", "key"}


def test_no_module_but_the_protocol_spells_a_key():
    """A family's name as an argument of a Cluster call, or a literal under a key
    root or a process group prefix, anywhere in the packages or the tests."""
    names = {f.name for f in p.FAMILIES}
    offenders = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.relative_to(ROOT).parts[0] not in ("bamboo", "agents", "sim", "schedules", "scripts", "tests") \
                or path.name in ("protocol.py", "test_protocol.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in KEY_METHODS and "cluster" in ast.unparse(node.func.value):
                offenders += [(path.name, a.value) for a in node.args
                              if isinstance(a, ast.Constant) and a.value in names]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith((p.ROOT, p.RENDEZVOUS_ROOT, "pg/", "bamboo-node-")):
                offenders.append((path.name, node.value))
    assert offenders == []
