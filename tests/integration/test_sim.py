"""The cluster simulator: hand-computed small cases, the real EC2 p3 trace with
GPT-2 at P=12 (the Bamboo paper's setting), and the bamboo-sim command."""
import json
import os
import subprocess
import sys

import pytest

from schedules.compiler import compile_schedule, simulate

from agents.policy import Config, next_config
from sim.accounting import RunState
from sim.auto import Auto
from sim.command import SWEEP_RATES, main
from sim.profiles import NETWORK, PROFILES, profile
from sim.simulator import STRATEGIES, ClusterSimulator, Options
from sim.strategies import Bamboo, CheckpointRestart, Lazy, OnDemand, RedoFromPeers
from sim.traces import Event, synthetic, with_outages
from schedules.options import ScheduleOptions

P3 = os.path.join(os.path.dirname(__file__), "..", "..", "traces", "ec2-p3-trace.csv")
BERT = PROFILES["bert-large"]
# The hand-computed cases of whole pipelines and relaunching rollbacks (the new
# short pipelines, notices and rollbacks from memory have cases of their own)
WHOLE = {"max_stages": 1, "rollback": "relaunch", "surplus": "keep", "replica_sync": "end"}  # the failover of `end`


def rate(pipelines, redundancy, frc="bubbles"):
    """Samples/s of D healthy pipelines, straight from the schedule simulator."""
    m = -(-BERT.microbatches // pipelines)
    makespan = simulate(compile_schedule(2, m, (), options=ScheduleOptions(redundancy=redundancy, frc=frc), cost=BERT.cost(2, pipelines))).makespan
    return BERT.samples_per_iteration() / (makespan / 1000)


def four_nodes_one_preempted():
    start = [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)]
    return start + [Event(1800, "remove", "n3", "b"), Event(3600, "add", "n4", "b")]


def test_checkpoint_restart_loses_the_work_since_the_checkpoint():
    opt = Options(checkpoint_seconds=1200, restart_seconds=120, **WHOLE)
    sim = ClusterSimulator(BERT, 2, "checkpoint", opt)
    r = sim.run(four_nodes_one_preempted(), hours=1.0)
    # two pipelines until 1800 s, back to the checkpoint at 1200 s, restart, one pipeline
    # that stalls once more for a write, 1200 s after the restart
    write = sim.costs.write_seconds
    assert write == pytest.approx(BERT.stage_params(2) * 12 * (1 / 10e9 + 1 / 0.5e9))
    expected = rate(2, "off") * 1200 + rate(1, "off") * (1800 - 120 - write)
    assert r["samples"] == pytest.approx(expected, abs=1)
    assert r["fatal_failures"] == 1 and r["preemptions"] == 1
    assert r["mean_nodes"] == pytest.approx(3.5) and r["cost_per_hour"] == pytest.approx(3.5 * 0.918, rel=1e-3)
    assert r["value"] == pytest.approx(r["throughput"] / r["cost_per_hour"], rel=1e-3)


@pytest.mark.parametrize("frc", ["all", "bubbles"])
def test_bamboo_pauses_one_merged_iteration_and_loses_nothing(frc):
    """With --frc all a failover pauses one merged iteration; with bubbles also the
    dead stage's forwards that no bubble held (the schedule's share of them)."""
    opt = Options(free_checkpoints=True, frc=frc, **WHOLE)  # only the failover counts here
    sim = ClusterSimulator(BERT, 2, "bamboo", opt)
    r = sim.run(four_nodes_one_preempted(), hours=1.0)
    sched = compile_schedule(2, 12, (), options=ScheduleOptions(redundancy="eager", frc=frc), cost=BERT.cost(2, 2))
    unplaced = 1 - sum(len(sched.frc_microbatches(n)) for n in (0, 1)) / 24
    assert 0 < unplaced < 1 if frc == "bubbles" else unplaced == 0
    forwards = sim.iteration_seconds(2, mode="off") / (3 * 2)  # a third of one stage's share of the work
    pause = sim.iteration_seconds(2, merged=True) + unplaced * forwards
    # the broken pipeline's survivor goes to standby: the other pipeline moves no layers
    expected = rate(2, "eager", frc) * 1800 + rate(1, "eager", frc) * (1800 - pause)
    assert r["samples"] == pytest.approx(expected, abs=1)
    assert r["fatal_failures"] == 0


def test_a_stage_lost_in_every_pipeline_is_fatal():
    start = [Event(0, "add", f"n{i}", "a") for i in range(4)]
    both = start + [Event(600, "remove", n, "a") for n in ("n0", "n1", "n2", "n3")]
    r = ClusterSimulator(BERT, 2, "bamboo", Options(**WHOLE)).run(both, hours=0.5)
    assert r["fatal_failures"] == 1 and r["redone_from_peers"] == 0
    pipeline = next_config({f"n{i}": "a" for i in range(4)}, None, 2).pipelines[0]
    one = start + [Event(600, "remove", n, "a") for n in pipeline]
    r = ClusterSimulator(BERT, 2, "bamboo", Options(**WHOLE)).run(one, hours=0.5)
    assert r["fatal_failures"] == 0 and r["redone_from_peers"] == 1


TWO_PIPES = Config(0, 2, (("n0", "n1"), ("n2", "n3")))


def one_batch(strategy, removed, saved=50.0, standby=(), frc="bubbles"):
    """React to the loss of `removed` from TWO_PIPES plus `standby`, with 80 samples done and `saved` saved."""
    sim = ClusterSimulator(BERT, 2, strategy, Options(frc=frc, **WHOLE))
    s = RunState(samples=80.0, saved=saved)
    config = Config(0, 2, TWO_PIPES.pipelines, tuple(standby))
    live = {n: "a" for n in ("n0", "n1", "n2", "n3", *standby) if n not in removed}
    return sim, s, sim.rules.react(sim, s, config, live, set(removed))


def test_strategy_names_map_to_classes():
    assert STRATEGIES == {"bamboo": Bamboo, "lazy": Lazy, "redo": RedoFromPeers, "checkpoint": CheckpointRestart,
                          "on-demand": OnDemand, "auto": Auto}
    assert isinstance(ClusterSimulator(BERT, 2, "bamboo").rules, Bamboo)


def test_bamboo_react_redoes_a_pipeline_lost_whole_from_the_other():
    sim, s, nxt = one_batch("bamboo", {"n0", "n1"})
    assert (s.fatal, s.redos, s.samples) == (0, 1, 80.0)
    assert s.paused_until == pytest.approx(Options().failure_timeout + sim.iteration_seconds(2))
    assert nxt.depth == 2 and nxt.pipelines == (("n2", "n3"),)


def test_bamboo_react_rewinds_when_a_stage_is_lost_everywhere():
    sim, s, nxt = one_batch("bamboo", {"n0", "n1", "n2", "n3"})
    assert (s.fatal, s.redos, s.samples, s.paused_until) == (1, 0, 50.0, sim.restart_seconds)
    assert nxt.pipelines == ()
    sim, s, nxt = one_batch("bamboo", {"n1", "n3"})  # stage 1 died in both, but nodes 0 and 2 hold it
    assert (s.fatal, s.redos, s.samples) == (0, 0, 80.0)
    assert nxt.pipelines in ((("n0", "n2"),), (("n2", "n0"),))  # a node moves stage: a reconfiguration
    handover = BERT.stage_state_bytes(2) * 2 / NETWORK
    unplaced = sim.uncovered(2) * sim.iteration_seconds(2, mode="off") / (3 * 2)  # forwards no bubble held
    assert s.paused_until == pytest.approx(sim.iteration_seconds(2, merged=True) + unplaced
                                           + Options().reconfigure_seconds + handover)


def test_lazy_runs_the_lazy_schedule_and_adds_the_dead_stage_s_forwards_to_eager_s_failover():
    """Lazy's iterations are bounded eager's, faster than --frc all's; its failover
    recomputes every forward of the dead stage, eager's (all) none of them."""
    lazy, s, nxt = one_batch("lazy", {"n1"})
    eager, e, _ = one_batch("bamboo", {"n1"}, frc="all")
    bounded, _, _ = one_batch("bamboo", {"n1"})
    assert lazy.throughput(2) == pytest.approx(rate(2, "lazy"))
    assert rate(2, "off") > lazy.throughput(2) > eager.throughput(2)
    assert bounded.throughput(2) == pytest.approx(lazy.throughput(2), rel=1e-12)
    forwards = lazy.iteration_seconds(2, mode="off") / (3 * 2)  # a third of one stage's share of the work
    assert s.paused_until == pytest.approx(e.paused_until + forwards) and s.samples == 80.0
    assert nxt.pipelines == (("n2", "n3"),)


@pytest.mark.parametrize("mode,strategy", [("eager", "bamboo"), ("lazy", "lazy"), ("off", "redo"), ("auto", "auto")])
def test_redundancy_picks_bamboo_s_mode(mode, strategy, capsys):
    assert main(["--trace", P3, "--strategy", "bamboo", "--redundancy", mode, "--hours", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == strategy


def test_checkpoint_react_restarts_on_a_used_node_only():
    sim, s, nxt = one_batch("checkpoint", {"n3"})
    assert (s.fatal, s.samples, s.paused_until) == (1, 50.0, sim.restart_seconds)
    # relaunch, load one stage's 12 bytes per parameter at 0.5 GB/s, warm up
    assert sim.restart_seconds == pytest.approx(60 + BERT.stage_params(2) * 12 / 0.5e9 + 30)
    assert len(nxt.pipelines) == 1
    _, s, nxt = one_batch("checkpoint", {"n4"}, standby=("n4",))
    assert (s.fatal, s.samples, s.paused_until) == (0, 80.0, 0.0)
    assert nxt.pipelines == TWO_PIPES.pipelines


def test_on_demand_runs_the_mean_cluster_without_preemptions():
    r = ClusterSimulator(BERT, 2, "on-demand").run(four_nodes_one_preempted(), hours=1.0)
    # 4 nodes, then 3, then 4 again: a mean of 3.5 rounds to 2 pipelines of 2
    assert r["mean_nodes"] == 4.0 and r["preemptions"] == r["fatal_failures"] == 0
    assert r["samples"] == pytest.approx(rate(2, "off") * 3600, abs=1)
    assert r["cost_per_hour"] == pytest.approx(4 * 3.06)


@pytest.mark.slow
def test_ec2_p3_trace_gpt2_p12_all_strategies():
    """Every strategy on the same fleet (--surplus keep: each holds every node the
    trace grants, so each sees the trace's 167 preemptions)."""
    res = subprocess.run([sys.executable, "-m", "sim.command", "--trace", P3, "--strategy", "all", "--model", "gpt2",
                          "--stages", "12", "--surplus", "keep", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    top = json.loads(res.stdout)
    out = top["strategies"]
    assert set(out) == set(STRATEGIES)
    for r in out.values():
        for key in ("preemptions", "fatal_failures", "mean_nodes", "throughput", "cost_per_hour", "value", "samples"):
            assert key in r
    assert top["trace"]["preemptions"] == 167 and top["trace"]["node_mtbf_hours"] == pytest.approx(1.635, abs=1e-3)
    assert top["profile"]["source"] == "calibrated" and top["profile"]["numbers"]["forward"].startswith("measured")
    assert out["bamboo"]["preemptions"] == out["checkpoint"]["preemptions"] == out["redo"]["preemptions"] == 167
    assert out["on-demand"]["preemptions"] == 0
    assert out["bamboo"]["fatal_failures"] < 6  # Bamboo's own simulator: 6; peers recover the rest
    for strategy in ("bamboo", "redo", "checkpoint"):
        params = out[strategy]["checkpointing"]
        assert params["formula"] == "daly" and params["write_seconds"] > 0 and params["checkpoints_taken"] > 0
        assert params["restart_seconds"] == pytest.approx(params["relaunch_seconds"] + params["load_seconds"]
                                                          + params["warmup_seconds"], abs=1e-2)
    # the honest baselines, each with the notice, short pipelines and its best interval:
    # redo from peers beats eager Bamboo (whose FRC is not yet confined to bubbles) and
    # checkpoint-restart, which relaunches on every death of a node in use
    assert out["redo"]["value"] > out["bamboo"]["value"] > out["on-demand"]["value"]
    assert out["redo"]["value"] > out["checkpoint"]["value"] > out["on-demand"]["value"]
    for name, r in out.items():  # the share of paid node-hours that trains, against what could
        if name != "on-demand":
            assert 0 < r["goodput"] <= r["goodput_bound"] <= 1.05 and 0 <= r["idle_fraction"] < 0.3
    assert out["auto"]["goodput"] >= out["auto"]["goodput_bound"] - 0.05
    # auto (the agents' choose() at every batch): within 2% of the best fixed mode, and
    # no worse than eager Bamboo (on this trace it runs Bamboo's own setting throughout,
    # eager with the sync in the next iteration, which bamboo's own sync choice also takes)
    assert out["auto"]["value"] >= out["bamboo"]["value"] and out["auto"]["value"] >= 0.98 * best_fixed(out)
    assert {setting.split("+")[0] for setting in out["auto"]["hours_per_mode"]} <= {"eager", "lazy", "off"}
    assert out["on-demand"]["cost_per_hour"] == pytest.approx(out["on-demand"]["mean_nodes"] * 3.06)


def best_fixed(values):
    """The best of eager, lazy, off (redo) and checkpoint-restart at its optimal interval."""
    return max(values[k]["value"] if isinstance(values[k], dict) else values[k]
               for k in ("bamboo", "lazy", "redo", "checkpoint"))


@pytest.mark.parametrize("stages", [6, 12])
def test_ec2_g4dn_trace_auto_within_2_percent_of_the_best_fixed_mode(stages, capsys):
    """The g4dn trace holds 12.6 nodes on average: P=6 gives two pipelines as P=12
    does on p3; at P=12 the job runs one pipeline or none, where off means a rollback."""
    g4dn = os.path.join(os.path.dirname(P3), "ec2-g4dn-trace.csv")
    assert main(["--trace", g4dn, "--strategy", "all", "--model", "gpt2", "--stages", str(stages)]) == 0
    top = json.loads(capsys.readouterr().out)
    out = top["strategies"]
    # a preemption of a node the job released costs it nothing: the job counts only its own
    assert top["trace"]["preemptions"] == 74 and 0 < out["redo"]["preemptions"] <= 74
    assert out["auto"]["value"] >= 0.98 * best_fixed(out)


@pytest.mark.slow  # make test-slow: a sweep of runs (the value itself is tested above)
def test_sweep_writes_the_value_plot(tmp_path):
    res = subprocess.run([sys.executable, "-m", "sim.command", "--sweep-rates", "--model", "bert-large", "--stages", "4",
                          "--seeds", "1", "--plot", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (tmp_path / "value-vs-rate.png").stat().st_size > 1000
    rows = out["sweep"]
    # docs/simulator.md's
    assert [r["rate"] for r in rows] == list(SWEEP_RATES) == [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2]
    # on-demand: the trace's mean cluster, the same until refills lag enough to shrink it (2 per node-hour)
    assert len({r["on-demand"] for r in rows if r["rate"] <= 1}) == 1
    assert all(r["auto"] >= 0.98 * best_fixed(r) for r in rows)  # the done-when, on this model
    assert rows[-1]["checkpoint"] < rows[0]["checkpoint"]  # restarts hurt more as preemptions grow


def test_the_simulator_page_s_sweep_table_has_the_sweep_s_rates():
    page = open(os.path.join(os.path.dirname(P3), "..", "docs", "simulator.md")).read()
    header = next(line for line in page.splitlines() if line.startswith("| preemptions per node-hour |"))
    assert [float(cell) for cell in header.strip(" |").split(" | ")[1:]] == list(SWEEP_RATES)


@pytest.mark.parametrize("args,needle", [
    (["--trace", "/nonexistent.csv"], "/nonexistent.csv"),
    (["--trace", P3, "--stages", "1"], "--stages"),
    (["--trace", P3, "--hours", "-1"], "--hours"),
    (["--strategy", "bamboo"], "--trace"),
    (["--trace", P3, "--storage-bandwidth", "-1"], "--storage-bandwidth"),
    (["--trace", P3, "--peer-bandwidth", "0"], "--peer-bandwidth"),
    (["--trace", P3, "--snapshot-bandwidth", "-2"], "--snapshot-bandwidth"),
    (["--trace", P3, "--checkpoint-minutes", "-5"], "--checkpoint-minutes"),
    (["--trace", P3, "--restart-seconds", "-1"], "--restart-seconds"),
    (["--trace", P3, "--bytes-per-param", "0"], "--bytes-per-param"),
    (["--trace", P3, "--warmup-seconds", "-1"], "--warmup-seconds"),
    (["--trace", P3, "--spot-price", "0"], "--spot-price"),
    (["--trace", P3, "--profile", "guess"], "--profile"),
    (["--trace", P3, "--strategy", "redo", "--redundancy", "lazy"], "--redundancy"),
    (["--trace", P3, "--redundancy", "sometimes"], "--redundancy"),
    (["--sweep-rates", "--redundancy", "off"], "--redundancy"),
    (["--trace", P3, "--notice-seconds", "-1"], "--notice-seconds"),
    (["--trace", P3, "--max-stages-per-node", "0"], "--max-stages-per-node"),
    (["--trace", P3, "--max-stages-per-node", "3"], "--max-stages-per-node"),
    (["--trace", P3, "--rollback", "never"], "--rollback"),
    (["--trace", P3, "--microbatches", "0"], "--microbatches"),
    (["--trace", P3, "--microbatches", "100000000"], "--microbatches must be at most 100000"),  # not a MemoryError
    (["--trace", P3, "--hours", "inf"], "--hours must be a finite number"),
    (["--trace", P3, "--hours", "nan"], "--hours must be a finite number"),
    (["--trace", P3, "--spot-price", "inf"], "--spot-price must be a finite number"),
    (["--trace", P3, "--bytes-per-param", "inf"], "--bytes-per-param must be a finite number"),
    (["--trace", P3, "--plot", P3], "is a file, not a directory"),
    (["--trace", P3, "--stages", "1"], "--stages must be at least 2"),
    (["--trace", P3, "--model", "bert-large", "--stages", "25"], "more than model bert-large's 24 layers"),
    (["--trace", P3, "--jobs", "two"], "--jobs must be at least 1, or auto (got two)"),
    (["--trace", P3, "--jobs", "-1"], "--jobs must be at least 1, or auto (got -1)"),
])
def test_bad_input_is_one_line(args, needle, capsys):
    """bamboo-sim's main in this process (a process each would import torch forty
    times); the test below runs the command itself."""
    try:
        status = main(args)
    except SystemExit as e:  # argparse's refusals
        status = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("args,needle", [(["--trace", "/nonexistent.csv"], "/nonexistent.csv"),
                                         (["--trace", P3, "--hours", "nan"], "--hours must be a finite number")])
def test_bad_input_from_a_real_process_is_one_line(args, needle):
    res = subprocess.run([sys.executable, "-m", "sim.command", *args], capture_output=True, text=True, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr


def test_auto_stays_without_redundancy_without_preemptions_and_adds_it_when_they_crowd():
    """No preemption: off all along (two pipelines), the value of redo from peers.
    A preemption every 18 s per node: a redundant mode most of the time."""
    calm = [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)]
    end = Options(replica_sync="end")  # the sync at the end makes redundancy cost something
    quiet = ClusterSimulator(BERT, 2, "auto", end).run(calm, hours=1.0)
    assert quiet["hours_per_mode"] == {"off": 1.0} and quiet["mode_switches"] == 0
    assert quiet["samples"] == pytest.approx(ClusterSimulator(BERT, 2, "redo").run(calm, hours=1.0)["samples"])
    from sim.traces import synthetic
    stormy = synthetic(1.0, 8, ("a", "b", "c"), rate=200.0, seed=1, refill_seconds=10)
    r = ClusterSimulator(BERT, 2, "auto", end).run(stormy, hours=1.0)
    redundant = sum(h for m, h in r["hours_per_mode"].items() if m != "off")
    assert redundant > r["hours_per_mode"].get("off", 0.0), r["hours_per_mode"]


def test_auto_keeps_eager_with_the_late_sync_where_it_costs_what_off_costs():
    """With the default sync (auto), eager's sync in the next iteration adds nothing
    to this iteration, so auto keeps the replicas at no cost: it trains exactly
    what redo from peers (no replicas at all) trains without preemptions."""
    calm = [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(4)]
    sim = ClusterSimulator(BERT, 2, "auto")
    assert sim.iteration_seconds(2, mode="eager", sync="next") == pytest.approx(sim.iteration_seconds(2, mode="off"))
    quiet = sim.run(calm, hours=1.0)
    assert quiet["hours_per_mode"] == {"eager+next": 1.0}
    assert quiet["samples"] == pytest.approx(ClusterSimulator(BERT, 2, "redo").run(calm, hours=1.0)["samples"])


def test_auto_on_one_pipeline_risks_off_with_a_checkpoint_while_deaths_are_rare():
    """One pipeline: off goes back to the checkpoint on a death, worth it without
    preemptions (the value of redo, which does the same), not when they crowd."""
    calm = [Event(0, "add", f"n{i}", "ab"[i % 2]) for i in range(2)]
    whole = Options(**WHOLE)  # one pipeline, and a rollback that relaunches
    quiet = ClusterSimulator(BERT, 2, "auto", whole).run(calm, hours=1.0)
    assert quiet["hours_per_mode"] == {"off": 1.0}
    assert quiet["samples"] == pytest.approx(ClusterSimulator(BERT, 2, "redo", whole).run(calm, hours=1.0)["samples"])
    from sim.traces import synthetic
    stormy = synthetic(1.0, 3, ("a", "b", "c"), rate=50.0, seed=1, refill_seconds=10)
    r = ClusterSimulator(BERT, 2, "auto", whole).run(stormy, hours=1.0)
    redundant = sum(h for m, h in r["hours_per_mode"].items() if m != "off")
    assert redundant > r["hours_per_mode"].get("off", 0.0), r["hours_per_mode"]


@pytest.mark.parametrize("model", ["gpt2", "bert-large"])
def test_bounded_eager_costs_no_iteration_time_over_lazy_on_the_calibrated_profiles(model):
    """Bounded eager's FRC adds nothing to the fault-free iteration at P=4..12 (the
    replica sync, which lazy pays too, is all it costs over off); --frc all's does."""
    for depth in range(4, 13):
        for pipelines in (1, 2):
            sims = {frc: ClusterSimulator(profile(model), depth, "bamboo", Options(frc=frc))
                    for frc in ("bubbles", "all")}
            lazy = sims["bubbles"].iteration_seconds(pipelines, mode="lazy")
            assert sims["bubbles"].iteration_seconds(pipelines) == pytest.approx(lazy, rel=1e-9)
            assert sims["all"].iteration_seconds(pipelines) > 1.05 * lazy
            assert 0 < sims["bubbles"].uncovered(pipelines) < 1 and sims["all"].uncovered(pipelines) == 0


def test_flags_the_run_does_not_read_are_named_in_a_note(capsys):
    """A trace run reads no --seeds; a sweep reads no --trace or --hours; lazy places
    no FRC. Each is said, and the run goes on (here to its own refusal: a trace run
    needs --trace, which the note lines come before)."""
    assert main(["--seeds", "5", "--strategy", "lazy", "--frc", "all", "--stages", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "bamboo-sim: note: --seeds does nothing in this run: they are for --sweep-rates"
    assert lines[1].startswith("bamboo-sim: note: --frc does nothing in this run: it places eager Bamboo's FRC")
    assert lines[2].startswith("bamboo-sim: error: --trace PATH is required") and len(lines) == 3
    from sim.command import build_parser, idle_notes
    parser = build_parser()
    sweep = parser.parse_args(["--sweep-rates", "--trace", P3, "--hours", "2", "--frc", "all"])
    assert idle_notes(parser, sweep) == ["--trace, --hours do nothing in this run: --sweep-rates runs every strategy "
                                         "on synthetic traces of its own"]
    assert idle_notes(parser, parser.parse_args(["--trace", P3, "--strategy", "auto", "--frc", "all"])) == []


def test_bad_frc_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--trace", P3, "--frc", "some"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--frc" in err[0] and "invalid choice" in err[0]


def test_auto_picks_eager_once_the_sync_is_off_the_critical_path(capsys):
    """Whole pipelines on the p3 trace: with the sync at the end auto runs off (redo),
    with it in the next iteration eager, whose iteration is then off's; left to
    choose the sync too (auto), it takes eager with the late sync, and runs as that."""
    whole = ["--trace", P3, "--hours", "3", "--strategy", "auto", "--max-stages-per-node", "1",
             "--notice-seconds", "0", "--rollback", "relaunch"]
    modes, values = {}, {}
    for sync in ("end", "next", "auto"):
        assert main(whole + ["--replica-sync", sync]) == 0
        out = json.loads(capsys.readouterr().out)
        modes[sync], values[sync] = set(out["hours_per_mode"]), out["value"]
    assert modes == {"end": {"off"}, "next": {"eager+next"}, "auto": {"eager+next"}}
    assert values["auto"] == values["next"] > values["end"]


def test_a_generated_trace_with_hourly_outages_and_zone_bursts_runs_to_the_end():
    """The bursty trace the docs use, shortened: every spot strategy at P=6 runs to
    the end, and its survival counts add up to no more than the deaths it saw.
    Every node the trace grants is kept (--surplus keep), so the job stops only in
    the outages; released, a burst may also leave it short of a pipeline between
    them."""
    events = with_outages(synthetic(12, 18, ("a", "b", "c"), 0.3, 1, bulk=0.5), 4 * 3600, 3600)
    fleet = [0]
    for e in sorted(events, key=lambda e: e.time):
        fleet.append(fleet[-1] + (1 if e.action == "add" else -1))
    assert min(fleet[1:]) == 0
    gpt2 = profile("gpt2", "calibrated")
    for strategy in (s for s in STRATEGIES if s != "on-demand"):
        out = ClusterSimulator(gpt2, 6, strategy, Options(surplus="keep")).run(events)
        assert out["hours"] > 11, strategy  # the last event is close to 12 h
        assert sum(out["deaths_survived"].values()) <= out["preemptions"], strategy
        assert out["checkpointing"]["checkpoints_skipped"] == 2, strategy  # one in each outage, at 4 h and 8 h
