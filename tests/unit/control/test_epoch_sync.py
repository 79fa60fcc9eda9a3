"""The replica sync of an epoch: the agents' choice (`Assignment.sync`) or the
job's --replica-sync, what the worker compiles and the handover reads; and the
agents' choice of it (`agents.modes.setting_for`) against `choose` run by hand."""
import pytest

from agents.modes import ModeStats, choose, job_estimates, setting_for
from bamboo.control.assignment import Assignment
from bamboo.control.config import JobConfig


def epoch(redundancy: str = "eager", sync: str = "") -> Assignment:
    return Assignment(1, 4, ((0, 1),), redundancy=redundancy, sync=sync)


@pytest.mark.parametrize("job, chosen, mode, runs", [
    ("end", "", "eager", "end"), ("next", "", "eager", "next"), ("auto", "", "eager", "end"),
    ("auto", "next", "eager", "next"), ("auto", "end", "lazy", "end"), ("auto", "next", "off", "end"),
    ("next", "", "off", "end"),
])
def test_an_epoch_runs_the_agents_sync_else_the_jobs_and_none_late_without_replicas(job, chosen, mode, runs):
    cfg = JobConfig.of(stages=2, redundancy="auto", replica_sync=job).schedule
    assert cfg.epoch_sync(epoch(mode, chosen)) == runs
    assert cfg.late_in(epoch(mode, chosen)) == (runs == "next")
    assert cfg.options(mode, cfg.epoch_sync(epoch(mode, chosen))).sync == runs


def test_an_assignments_sync_goes_through_etcd_and_a_bad_one_is_refused():
    a = epoch("eager", "next")
    assert Assignment.from_dict(a.to_dict()) == a
    assert Assignment.from_dict({**a.to_dict(), "sync": ""}).sync == ""
    assert Assignment.from_dict({k: v for k, v in a.to_dict().items() if k != "sync"}).sync == ""  # an older record
    for bad in ("later", 3, "none"):
        with pytest.raises(ValueError, match="sync"):
            Assignment.from_dict({**a.to_dict(), "sync": bad})


@pytest.mark.parametrize("redundancy, sync, rate", [
    ("eager", "auto", 0.0), ("eager", "auto", 1e4), ("auto", "auto", 0.0), ("auto", "auto", 1e4),
    ("auto", "next", 1e4), ("lazy", "auto", 50.0),
])
def test_the_agents_pick_a_setting_the_job_allows_as_choose_does(redundancy, sync, rate):
    """`setting_for` gives `choose` the settings the job allows (its one mode, or
    every mode; each sync it allows) and returns the mode and, where the job leaves
    it to them, the sync ("" where the job fixes it)."""
    cfg = JobConfig.of(stages=4, microbatches=8, redundancy=redundancy, replica_sync=sync, checkpoint="/tmp/ck",
                       checkpoint_every=4, auto_prior_rate=rate)
    stats, now = ModeStats(seconds={"off": 2.0}), Assignment(2, 8, ((0, 1, 2, 3),))
    seconds, pause, rollback = job_estimates(cfg, stats, 4, 1)
    allowed = {n: t for n, t in seconds.items() if redundancy == "auto" or n.split("+")[0] == redundancy}
    want = choose("", rate, 4, 1, allowed, pause, rollback)
    mode, chosen = setting_for(cfg, now, stats)
    assert mode == want.split("+")[0]
    assert chosen == ("" if sync != "auto" else ("next" if "+next" in want else "end"))
    if redundancy == "eager":  # no deaths: the late sync's shorter iteration; many: the end's whole failover
        assert chosen == ("next" if rate == 0 else "end")


def test_a_job_that_fixes_both_is_not_chosen_for():
    cfg = JobConfig.of(stages=2, redundancy="lazy", replica_sync="next")
    assert not cfg.schedule.chooses and setting_for(cfg, epoch(), None) == ("lazy", "")


@pytest.mark.parametrize("testing, pipelines, checkpoint, allowed", [
    ({}, 2, None, ("end", "next")), ({}, 1, "/tmp/ck", ("end", "next")), ({}, 1, None, ("end",)),
    ({"compute_ahead": True}, 2, "/tmp/ck", ("end", "next")), ({"check_replicas": True}, 3, "/tmp/ck", ("end",)),
])
def test_auto_takes_the_late_sync_only_where_it_runs_and_a_window_death_has_a_way_back(testing, pipelines,
                                                                                     checkpoint, allowed):
    """--replica-sync auto: the late sync needs a peer pipeline or a checkpoint for a
    death in its window, and does not run with --check-replicas (it does with --compute-ahead);
    where it may not, the agents keep the sync at the end, whatever the estimates."""
    from agents.modes import syncs_allowed
    cfg = JobConfig.of(stages=4, microbatches=8, redundancy="eager", replica_sync="auto", checkpoint=checkpoint,
                       auto_prior_rate=0.0, **testing)
    assert syncs_allowed(cfg, pipelines) == allowed
    now = Assignment(2, 8, tuple(tuple(range(j * 4, j * 4 + 4)) for j in range(pipelines)))
    assert setting_for(cfg, now, ModeStats(seconds={"off": 2.0})) == ("eager", allowed[-1])
    fixed = JobConfig.of(stages=4, redundancy="eager", replica_sync="next", checkpoint="/tmp/ck")
    assert syncs_allowed(fixed, 1) == ("next",)


def test_a_wanted_sync_is_kept_only_where_the_new_epoch_allows_it():
    """The setting picked after the iteration before an epoch (`wanted`) stands, but
    a late sync wanted for two pipelines is chosen again for an epoch left with one
    and no checkpoint (it may not run there), and a sync read from etcd that is no
    sync at all is not written into an epoch."""
    from bamboo.control.protocol import ModeChoice
    cfg = JobConfig.of(stages=4, microbatches=8, redundancy="eager", replica_sync="auto", auto_prior_rate=0.0)
    two = Assignment(2, 8, ((0, 1, 2, 3), (4, 5, 6, 7)))
    one = Assignment(3, 9, ((0, 1, 2, 3),))
    wanted = ModeChoice("eager", {}, "next")
    assert setting_for(cfg, two, ModeStats(), wanted) == ("eager", "next")
    assert setting_for(cfg, one, ModeStats(), wanted) == ("eager", "end")
    assert setting_for(cfg, two, ModeStats(), ModeChoice("eager", {}, "later"))[1] in ("end", "next")
