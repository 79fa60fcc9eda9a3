"""bamboo-sim --replica-sync auto: eager Bamboo chooses its replica sync at every
reconfiguration with the agents' own choice (agents/modes.py `choose`), against
the same runs with the sync fixed at the end and in the next iteration."""
import pytest

from sim.profiles import profile
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event

GPT2 = profile("gpt2", "calibrated")


def churn(gap: float, hours: float = 2.0, nodes: int = 5) -> list[Event]:
    """`nodes` nodes in zones a and b; every `gap` seconds one of them is preempted
    (in turn) and a new one comes 10 s later."""
    events = [Event(0.0, "add", f"n{i}", "ab"[i % 2]) for i in range(nodes)]
    alive, t, k = [f"n{i}" for i in range(nodes)], gap, nodes
    while t < hours * 3600:
        victim = alive.pop(0)
        events += [Event(t, "remove", victim), Event(t + 10, "add", f"n{k}", "ab"[k % 2])]
        alive.append(f"n{k}")
        t, k = t + gap, k + 1
    return events


def runs(events: list[Event]) -> dict[str, dict]:
    return {sync: ClusterSimulator(GPT2, 4, "bamboo", Options(replica_sync=sync, surplus="keep")).run(events)
            for sync in ("end", "next", "auto")}


def test_rare_deaths_take_the_late_sync_and_run_as_it_does():
    """One death an hour: the sync off the critical path is worth its window, and
    the run is the fixed `next` run, to the sample."""
    out = runs(churn(3600))
    assert set(out["auto"]["hours_per_mode"]) == {"eager+next"} and out["auto"]["mode_switches"] == 0
    assert out["auto"]["samples"] == out["next"]["samples"] and out["auto"]["value"] > out["end"]["value"]


def test_deaths_that_keep_landing_in_the_window_move_the_sync_back_to_the_end():
    """A death every 30 s on one pipeline: with the late sync a death often finds a
    replica a step behind (in a window, or between iterations) and rolls the job
    back, so the fixed `next` run trains less than the fixed `end` run; auto,
    counting the deaths it sees fall in windows, switches to the sync at the end
    within minutes and stays there."""
    out = runs(churn(30))
    assert out["next"]["samples"] < out["end"]["samples"]
    hours = out["auto"]["hours_per_mode"]
    assert out["auto"]["mode_switches"] == 1 and hours["eager"] > 5 * hours["eager+next"]


def zone_bursts(gap: float, hours: float = 2.0, nodes: int = 8) -> list[Event]:
    """`nodes` nodes in zones a and b; every `gap` seconds zone a loses all its nodes
    at once, and as many new ones come back 60 s later."""
    events = [Event(0.0, "add", f"n{i}", "ab"[i % 2]) for i in range(nodes)]
    in_a, t, k = [f"n{i}" for i in range(0, nodes, 2)], gap, nodes
    while t < hours * 3600:
        events += [Event(t, "remove", n) for n in in_a]
        in_a = [f"n{k + j}" for j in range(len(in_a))]
        events += [Event(t + 60, "add", n, "a") for n in in_a]
        t, k = t + gap, k + len(in_a)
    return events


def test_zone_bursts_that_take_a_stage_from_every_pipeline_move_auto_to_the_replicas():
    """Bursts that kill a stage in both pipelines at once: off has no peer to redo
    from and rolls back, which eager's replicas (a neighbour's copy) avoid, so the
    fixed eager run trains more than redo from peers. Auto, which starts in off,
    counts those rollbacks against off and moves to the replicas after the first
    burst, for most of the run (had it charged off a redo, it would stay in off)."""
    events = zone_bursts(900)
    opt = Options(surplus="keep")
    out = {s: ClusterSimulator(GPT2, 4, s, opt).run(events) for s in ("bamboo", "redo", "auto")}
    assert out["bamboo"]["value"] > out["redo"]["value"]
    hours = out["auto"]["hours_per_mode"]
    assert sum(h for m, h in hours.items() if m != "off") > 4 * hours.get("off", 0.0), hours


def test_auto_charges_a_window_death_on_two_pipelines_a_lent_failover_unless_seen_stale():
    """Two pipelines: a death in a late sync's window is lent to by another
    pipeline's owner of the stage (taken to be alive), so eager+next pays its
    failover and the transfer in the window's share, no redo; the share of deaths
    the run has seen find a replica a step behind is still redone. One pipeline
    rolls the window back, as before."""
    from sim.auto import window_rollback
    from sim.windows import mean_share
    sim = ClusterSimulator(GPT2, 4, "auto", Options())
    auto, off = sim.rules, sim.iteration_seconds(2, mode="off")
    seconds = sim.iteration_seconds(2, mode="eager", sync="next")
    failover = sim.iteration_seconds(2, merged=True, mode="eager", sync="next") + off / 12 * sim.uncovered(2, "next")
    window = mean_share(sim.windows(2, "eager", "next"))
    lent = failover + window * GPT2.cost(4).sync_transfer / 1000
    redo = sim.opt.failure_timeout + seconds
    assert 0 < window and failover < lent < redo
    assert auto._pause(sim, (2, 8, 0.05), (seconds, off, 1e6), "eager", "next") == pytest.approx(lent)
    auto.late, auto.stale = 4.0, 1.0  # a quarter of the late batches seen redone for a stale replica
    assert auto._pause(sim, (2, 8, 0.05), (seconds, off, 1e6), "eager", "next") == \
        pytest.approx(0.75 * lent + 0.25 * redo)
    auto.late = auto.stale = 0.0
    one, off = sim.iteration_seconds(1, mode="eager", sync="next"), sim.iteration_seconds(1, mode="off")
    failover = sim.iteration_seconds(1, merged=True, mode="eager", sync="next") + off / 12 * sim.uncovered(1, "next")
    window = mean_share(sim.windows(1, "eager", "next"))
    assert auto._pause(sim, (1, 4, 0.05), (one, off, 1e6), "eager", "next") == \
        pytest.approx((1 - window) * failover + window * window_rollback(sim, 0.05 * window, 4))
