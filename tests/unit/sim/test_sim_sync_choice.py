"""bamboo-sim --replica-sync auto: eager Bamboo chooses its replica sync at every
reconfiguration with the agents' own choice (agents/modes.py `choose`), against
the same runs with the sync fixed at the end and in the next iteration."""
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
