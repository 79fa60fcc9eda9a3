"""--checkpoint-formula best: every spot strategy's checkpoints at the interval of
the most value on the trace; the chosen run is the one a fixed interval gives."""
import json

import pytest

from sim import command

P3 = ["--trace", "traces/ec2-p3-trace.csv", "--hours", "4", "--stages", "6"]


def sim(capsys, *argv) -> dict:
    assert command.main([*P3, *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_best_interval_s_run_is_the_one_that_interval_gives_alone(capsys):
    best = sim(capsys, "--strategy", "checkpoint", "--checkpoint-formula", "best")
    search = best["checkpoint_search"]
    assert set(search["value_by_interval"]) == {"daly", "young", "1 min", "2 min", "5 min", "10 min", "20 min",
                                                "30 min", "60 min", "120 min", "never"}
    assert best["value"] == max(search["value_by_interval"].values())
    chosen = search["chosen"]
    alone = sim(capsys, "--strategy", "checkpoint",
                *(["--checkpoint-minutes", chosen.split()[0]] if chosen.endswith(" min") else
                  ["--checkpoint-formula", chosen] if chosen in ("daly", "young") else []))
    if chosen != "never":
        assert alone["value"] == best["value"] and alone["throughput"] == best["throughput"]
    daly = sim(capsys, "--strategy", "checkpoint")
    assert daly["value"] == search["value_by_interval"]["daly"] <= best["value"]


def test_every_spot_strategy_is_searched_and_on_demand_is_not(capsys):
    out = sim(capsys, "--strategy", "all", "--jobs", "1", "--checkpoint-formula", "best")  # no process here
    for strategy, result in out["strategies"].items():
        assert ("checkpoint_search" in result) == (strategy != "on-demand"), strategy


def test_the_search_is_for_one_trace_not_a_sweep(capsys):
    assert command.main(["--sweep-rates", "--stages", "4", "--checkpoint-formula", "best"]) == 2
    err = capsys.readouterr().err
    assert "not with --sweep-rates or --checkpoint-minutes" in err and err.count("\n") == 1
    assert command.main([*P3, "--checkpoint-formula", "best", "--checkpoint-minutes", "5"]) == 2
    assert "not with --sweep-rates or --checkpoint-minutes" in capsys.readouterr().err
