"""bamboo-status's timeline (commands/status/runstats.py `events`): a failover that
took a stage over on gradients lent by another pipeline says who lent what, and
puts the redo it spared beside the iteration's pause: the failure timeout and an
undisturbed iteration again, read from the run's own iterations."""
from bamboo.control.assignment import Assignment
from bamboo.control.config import JobConfig
from bamboo.control.events import FailedOver
from commands.status.jobview import Finished, Look
from commands.status.runstats import iterations, pauses, typical_seconds, events


def run(lent_by) -> list[dict]:
    """Five iterations 2 s apart, but the third, 2.5 s: its failover lent or not."""
    cfg = JobConfig.of(name="tiny", stages=2, microbatches=4, failure_timeout=3.0)
    failover = FailedOver(2, 2, 5, 3, 0.125, lent_by, "reduced" if lent_by is not None else "", 0.0625)
    ends = [0.0, 2.0, 4.5, 6.5, 8.5]
    done = [Finished(i, end, 0, 1.0, None, (failover.to_dict(),) if i == 2 else ()) for i, end in enumerate(ends)]
    look = Look("j", cfg, 0.0, assignments={0: Assignment(0, 0, ((0, 1), (2, 3)))}, done=done)
    series = iterations(look)
    typical = typical_seconds(look, series)
    assert typical == 2.0
    return [e for e in events(look, series, pauses(series, typical), typical) if e["type"] == "failover"]


def test_a_failover_on_lent_gradients_names_the_lender_and_the_redo_it_spared():
    [event] = run(lent_by=0)
    assert event["pause"] == 0.5 and event["iteration"] == 2
    assert "with its stage's reduced gradients lent by node 0 in 0.062 s instead of a redo" in event["text"]
    assert "a redo would take about 5.000 s" in event["text"]  # 3 s timeout + a 2 s iteration


def test_a_failover_on_its_own_replica_says_nothing_of_loans():
    [event] = run(lent_by=None)
    assert event["text"] == "node 3 took node 2's stage over (agreed in 0.125 s)"
