"""The bill beyond the nodes (sim/pricing.py) and the estimate that compares
placements (sim/estimate.py), against hand counts and the behaviour they promise."""
import json

import pytest
import transformers

from agents.policy import Config
from sim import command
from sim.estimate import ONE_ZONE, SPREAD, Market, cheapest, estimate
from sim.options import Options
from sim.pricing import Charges, crossing_shares, priced
from sim.profiles import Profile, profile


def test_crossing_shares_count_each_kind_of_pair_by_hand():
    zones = {"a1": "a", "a2": "a", "b1": "b", "c1": "c"}
    config = Config(0, 2, (("a1", "b1"), ("a2", "c1")))
    shares = crossing_shares(config, zones)
    # boundaries a1->b1 and a2->c1 both leave their zone; syncs b1->a1, a1->b1, c1->a2, a2->c1 too
    assert shares["activations, forward"] == shares["input gradients, back"] == 1.0
    assert shares["replica syncs"] == 1.0
    # the rings: stage 0 is a1<->a2 (one zone, twice), stage 1 is b1<->c1 (two zones, twice)
    assert shares["data-parallel reduce"] == 0.5
    same = crossing_shares(config, dict.fromkeys(zones, "a"))
    assert set(same.values()) == {0.0}


def test_priced_adds_each_charge_and_divides_by_the_tokens():
    run = {"hours": 2.0, "throughput": 10.0, "cost_per_hour": 3.6}   # 10 sequences/s of 1000 tokens
    charges = Charges(cross_zone_per_gib=0.02, etcd_per_hour=0.5, storage_per_gib_month=0.73, stored_gib=100,
                      boot_seconds=360)
    out = priced(run, 20, 1.0, 1000, 100, 1 << 30, charges)
    # 360 iterations an hour (10 sequences/s, 100 an iteration), 1 GiB across zones each
    assert out["dollars_per_hour"] == {"nodes": 3.6, "boot": 20 * 0.1 * 1.0 / 2, "network": 7.2, "etcd": 0.5,
                                       "storage": 0.1}
    assert out["tokens_per_second"] == 10_000
    assert out["dollars_per_billion_tokens"] == pytest.approx(sum(out["dollars_per_hour"].values()) / 0.036, 0.01)


def _small() -> Profile:
    return Profile("small", layers=8, hidden=512, seq=256, microbatch=2, microbatches=8)


def _placed(price: float, bursts: float, burst_hours: float = 1.0) -> dict:
    prof = _small()
    market = Market(rate=0.3, bursts=bursts, burst_hours=burst_hours, hours=6, seeds=2)
    result = estimate((prof, prof.links(4, 2, True), prof.seq), 8, 4, ("a", "b", "c"), Options(),
                      Charges(cross_zone_per_gib=price), market)
    assert set(result) == {SPREAD, ONE_ZONE} and "on-demand" in result[ONE_ZONE] and "on-demand" not in result[SPREAD]
    return {p: result[p]["bamboo"] for p in result} | {"cheapest": cheapest(result)}


def test_bytes_priced_high_without_bursts_make_one_zone_cheaper():
    placed = _placed(5.0, 0.0)
    assert placed[ONE_ZONE]["dollars_per_billion_tokens"] < placed[SPREAD]["dollars_per_billion_tokens"]
    assert placed[ONE_ZONE]["dollars_per_hour"]["network"] == 0.0 < placed[SPREAD]["dollars_per_hour"]["network"]
    assert placed["cheapest"][0] == ONE_ZONE


def test_zone_bursts_stop_a_job_in_one_zone_and_not_one_spread():
    """Every preemption a whole zone, gone three hours: spread, the replicas outlive
    it and training goes on; in one zone it stops until the zone is back. (Per
    token it may still be cheaper: nothing is paid while nothing runs.)"""
    placed = _placed(0.0, 1.0, burst_hours=3.0)
    assert placed[SPREAD]["tokens_per_second"] > 1.2 * placed[ONE_ZONE]["tokens_per_second"]


def test_a_profile_of_parameters_runs_the_12_h_squared_arithmetic_when_they_are_12_h_squared():
    gpt2 = profile("gpt2", "arithmetic")
    b, s, h = gpt2.microbatch, gpt2.seq, gpt2.hidden
    by_hand = (24 * b * s * h * h + 4 * b * s * s * h) / gpt2.gpu_flops * 1e3
    assert gpt2.layer_forward_ms == pytest.approx(by_hand)
    counted = Profile("x", gpt2.layers, h, s, b, gpt2.microbatches, params=12 * h * h * gpt2.layers)
    assert counted.layer_forward_ms == pytest.approx(by_hand)


def test_bamboo_sim_takes_a_bamboo_train_model_counted_as_transformers_counts_it(capsys):
    code = command.main(["--trace", "traces/bursty-zones.csv", "--hours", "1", "--model", "hf:llama-tiny",
                         "--stages", "2", "--instance-type", "g5.xlarge", "--cross-zone-price", "0.02"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    from bamboo.model.sizes import NAMED
    config = transformers.LlamaConfig(**{k: v for k, v in NAMED["llama-tiny"].items() if k != "model_type"})
    reference = transformers.LlamaForCausalLM(config).num_parameters()
    assert out["job"]["parameters"] == reference
    assert out["prices"] == {"spot": 0.45, "on_demand": 1.006}
    paid = out["priced"]
    assert paid["dollars_per_hour"]["network"] > 0
    assert paid["dollars_per_billion_tokens"] == pytest.approx(
        paid["total_per_hour"] / (paid["tokens_per_second"] * 3600) * 1e9, rel=0.01)


@pytest.mark.parametrize("argv,says", [
    (["--model", "gpt2", "--seq", "64"], "--seq is for a bamboo-train model"),
    (["--model", "hf:nope"], "hf:nope"),
    (["--model", "gpt2", "--instance-type", "g5.xlarge", "--spot-price", "1"], "--instance-type sets the prices"),
    (["--model", "gpt2", "--prices", "p.json"], "--prices goes with --instance-type"),
    (["--model", "gpt2", "--cross-zone-price", "-1"], "--cross-zone-price must be from 0 up"),
    (["--model", "hf:llama-tiny", "--batch", "0"], "--batch and --seq must be at least 1"),
    (["--model", "hf:llama-tiny", "--microbatches", "0"], "--microbatches must be at least 1"),
    (["--model", "gpt2", "--stages", "0"], "--stages must be at least 2"),
    (["--acquire-seconds", "-1"], "--acquire-seconds must be a finite number, not negative"),
    (["--fixed-standby", "-1"], "--fixed-standby must not be negative"),
    (["--spot-price", "-1"], "--spot-price must be positive"),
])
def test_bamboo_sim_refuses_a_bad_model_or_bill_in_one_line(capsys, argv, says):
    code = command.main(["--trace", "traces/bursty-zones.csv", "--hours", "1", "--stages", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_an_unknown_surplus_rule_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        command.main(["--trace", "traces/bursty-zones.csv", "--surplus", "lots"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1
    assert "invalid choice: 'lots' (choose from 'burst', 'binomial', 'fixed', 'keep')" in err


def test_the_ledger_in_dollars_is_the_whole_bill_by_part(capsys):
    """Node-hours by part at the node price, and boot, network and etcd beside them:
    they add up to the run's priced total, and the node parts to its nodes' cost."""
    code = command.main(["--trace", "traces/bursty-zones.csv", "--hours", "2", "--stages", "6", "--strategy", "all",
                         "--jobs", "1", "--instance-type", "g5.xlarge", "--cross-zone-price", "0.02", "--etcd-price", "0.02",
                         "--boot-seconds", "300"])
    assert code == 0
    for strategy, run in json.loads(capsys.readouterr().out)["strategies"].items():
        bill, paid = run["ledger_dollars"], run["priced"]
        assert sum(bill.values()) == pytest.approx(paid["total_per_hour"] * paid["hours"], rel=1e-3), strategy
        nodes = sum(v for k, v in bill.items() if k not in ("boot", "network", "etcd", "storage"))
        assert nodes == pytest.approx(run["cost_per_hour"] * run["hours"], rel=1e-3), strategy
        assert ("network" in bill) == (strategy != "on-demand")


def test_zone_spread_auto_prices_each_strategy_s_placement_at_the_cheaper_bill(capsys):
    """bursty-zones, two hours, GPT-2 at P=6, bytes between zones at $0.02/GiB:
    under --zone-spread auto each strategy's bill per billion tokens is within 2% of
    the cheaper of spread and pack, each run on its own; and eager Bamboo, whose
    replica syncs cross every boundary spread, is cheaper packed."""
    bills = {}
    for how in ("spread", "pack", "auto"):
        code = command.main(["--trace", "traces/bursty-zones.csv", "--hours", "2", "--stages", "6", "--model", "gpt2",
                             "--strategy", "all", "--jobs", "1", "--cross-zone-price", "0.02", "--zone-spread", how])
        assert code == 0
        bills[how] = {s: r["priced"]["dollars_per_billion_tokens"]
                      for s, r in json.loads(capsys.readouterr().out)["strategies"].items() if s != "on-demand"}
    for strategy, auto in bills["auto"].items():
        assert auto <= 1.02 * min(bills["spread"][strategy], bills["pack"][strategy]), (strategy, bills)
    assert bills["pack"]["bamboo"] < bills["spread"]["bamboo"]


def test_an_unknown_zone_spread_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        command.main(["--trace", "traces/bursty-zones.csv", "--zone-spread", "wide"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'wide'" in err
