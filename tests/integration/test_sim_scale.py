"""bamboo-sim's own run time and its processes: `--jobs 2` prints what one process
prints, each strategy's run time beside it; and the 1,000-node month of
docs/performance.md, every strategy (slow: `make test-slow`). In integration, as
`--jobs` starts processes."""
import json

import pytest

from sim.command import main
from sim.simulator import STRATEGIES
from sim.traces import synthetic, write_events

ZONES = ("a", "b", "c", "d")


def without_run_seconds(out: dict) -> dict:
    return {k: without_run_seconds(v) if isinstance(v, dict) else v for k, v in out.items() if k != "run_seconds"}


def test_jobs_print_what_one_process_prints_with_each_run_time(tmp_path, capsys):
    trace = tmp_path / "fleet.csv"
    write_events(synthetic(4, 48, ZONES, 0.05, 3, bulk=0.1), str(trace))
    argv = ["--trace", str(trace), "--strategy", "all", "--stages", "4", "--microbatches", "24"]
    outs = []
    for jobs in ("1", "2"):
        assert main([*argv, "--jobs", jobs]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert without_run_seconds(outs[0]) == without_run_seconds(outs[1])
    for out in outs:
        assert out["run_seconds"] >= max(r["run_seconds"] for r in out["strategies"].values()) >= 0
    assert main([*argv, "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_thousand_nodes_for_a_month_every_strategy(tmp_path, capsys):
    """The trace of docs/performance.md's figure (scripts/make_trace.py with these
    arguments): every strategy runs it, and each ledger adds up."""
    trace = tmp_path / "fleet.csv"
    write_events(synthetic(720, 1000, ZONES, 0.002, 1, bulk=0.002, refill_seconds=600), str(trace))
    assert main(["--trace", str(trace), "--strategy", "all", "--model", "gpt2", "--stages", "12",
                 "--microbatches", "672", "--jobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["strategies"]) == set(STRATEGIES)
    for strategy, run in out["strategies"].items():
        assert sum(run["ledger"].values()) == pytest.approx(run["mean_nodes"] * run["hours"], abs=1.0), strategy
