"""bamboo-status's timeline says why an iteration was run again: the reason the node
that gave it up wrote, which the agents keep in the redo's epoch (Assignment.why,
read back from etcd as untrusted: a string, bounded)."""
import pytest

from bamboo.control.assignment import WHY_CHARS, Assignment, Restore
from bamboo.control.config import JobConfig
from commands.status.jobview import Finished, Look
from commands.status.runstats import events, iterations, pauses, typical_seconds

WHY = "pipeline 1: failed nodes 0 and 1 are adjacent: stage 1 has no copy left in this pipeline"


def test_a_redo_says_why_the_iteration_was_given_up():
    cfg = JobConfig.of(name="tiny", stages=2, microbatches=4)
    first = Assignment(0, 0, ((0, 1), (2, 3)))
    redo = Assignment(1, 2, ((2, 3),), failed=(0, 1), redo=True, layers_from=0, why=WHY)
    done = [Finished(i, 2.0 * i, 0, 1.0, None, ()) for i in range(4)]
    look = Look("j", cfg, 0.0, assignments={0: first, 1: redo}, done=done)
    series = iterations(look)
    typical = typical_seconds(look, series)
    [event] = [e for e in events(look, series, pauses(series, typical), typical) if e["type"] == "redo"]
    assert event["text"].endswith(f"(why: {WHY})") and "runs iteration 2 again" in event["text"]


def test_the_reason_travels_through_etcd_bounded_and_typed():
    a = Assignment(3, 5, ((0, 1),), redo=True, restore=Restore.PEERS, why=WHY)
    assert Assignment.from_dict(a.to_dict()) == a
    long = {**a.to_dict(), "why": "x" * (WHY_CHARS * 10)}
    assert len(Assignment.from_dict(long).why) == WHY_CHARS
    with pytest.raises(ValueError, match="why is int"):
        Assignment.from_dict({**a.to_dict(), "why": 7})
    assert Assignment.from_dict({k: v for k, v in a.to_dict().items() if k != "why"}).why == ""  # written before
