"""bamboo-scale's emulated nodes against a real etcd: what they write per iteration,
counted by a watch of the test's own, against the protocol's table
(docs/ARCHITECTURE.md) and, slow, against a real job of the same shape; a burst
survived; the command's bad input."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from bamboo.control.etcd import EtcdServer
from commands.scale.census import Census
from commands.scale.cli import main
from commands.scale.harness import Shape, run
from tests.training import bamboo_train

SHAPE = Shape(nodes=8, stages=4, seconds=0.4, iterations=9, kill_at=5, burst=1, failure_timeout=1.5)


@pytest.mark.parametrize("processes", [1, 3])
def test_emulated_nodes_write_the_protocols_keys_and_survive_a_burst(processes):
    """The same in one process and shared out over three (where a pipeline's notes to
    its collector cross processes: lost ones would make each node write its own mark)."""
    result = run(replace(SHAPE, processes=processes), job="scale-test")
    assert result.errors == []
    pipelines, microbatches = SHAPE.nodes // SHAPE.stages, 2 * SHAPE.nodes
    assert result.pipelines == pipelines
    writes = result.writes
    assert writes["finished"] == SHAPE.nodes            # every node's mark
    assert writes["regroup"] == 1                        # one record per boundary
    assert writes["loss"] == microbatches                # every microbatch's loss
    assert writes["reduced"] == 2 * SHAPE.stages         # two members of every stage's reduce (D > 1)
    assert writes["done"] == SHAPE.nodes                 # every report, once
    assert set(writes) == {"finished", "regroup", "loss", "reduced", "done"}
    # each pipeline's marks (with the reports) and its losses, two per stage's reduce, the regroup
    assert result.transactions == 2 * pipelines + 2 * SHAPE.stages + 1
    # etcd's own count: per iteration the regroup to each worker and each report to the boundary's
    # leader, not also the regroup to every agent (3 a node)
    assert 2 * SHAPE.nodes <= result.watch_events < 3 * SHAPE.nodes
    # a worker's 10 readers share 6 prefixes' watches (one each), an agent watches 5, only the leading
    # agent the 5 its decisions read and only the boundary's leader done/ (twice if the dead led: a
    # node gone keeps its watches in the emulator); and the census's own watch
    assert 11 * SHAPE.nodes + 6 <= result.watchers <= 11 * SHAPE.nodes + 2 * (5 + 1) + 1
    assert result.to_agreement_s is not None and result.to_assignment_s is not None
    assert result.burst_events > 0  # counted when the next epoch was seen (at least its assignment's)
    assert result.to_agreement_s <= result.to_assignment_s  # the agents write the epoch the boundary asked for


@pytest.mark.parametrize("argv,said", [
    (["--nodes", "ten"], "--nodes: a comma-separated list"),
    (["--nodes", "2"], "--nodes: each count between --stages"),
    (["--stages", "1"], "--stages must be at least 2"),
    (["--kill-at", "20"], "--kill-at must be -1 or between 3"),
    (["--burst", "0"], "--burst must be between 1"),
    (["--iteration-seconds", "nan"], "--iteration-seconds must be between"),
    (["--json", "/no/such/dir/out.json"], "its directory does not exist"),
    (["--processes", "0"], "--processes must be auto or between 1"),
    (["--processes", "two"], "--processes: a count or auto"),
])
def test_bad_input_is_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert said in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_emulated_writes_equal_a_real_jobs(tmp_path):
    """A real job of 8 agents and workers (the same depth, microbatches and mode):
    its fault-free iterations write what the emulated nodes write, family by family."""
    shape = Shape(nodes=8, stages=4, seconds=0.5, iterations=10, kill_at=-1)
    result = run(shape, job="emulated")
    emulated = result.writes
    with EtcdServer() as etcd:
        census = Census(etcd.endpoint, "real")
        try:
            bamboo_train(tmp_path / "m.jsonl", "--model", "tiny", "--stages", "4", "--local-nodes", "8",
                         "--microbatches", str(2 * 8), "--iterations", "10", "--redundancy", "eager",
                         "--replica-sync", "end", "--surplus", "keep", "--etcd", etcd.endpoint, "--job", "real")
            census.catch_up()
            real = census.per_iteration(range(2, 9))
            transactions = census.transactions(range(2, 9))
        finally:
            census.close()
    assert real == emulated
    # one per pipeline for its marks and one for its losses, two per stage's reduce, the regroup
    assert transactions == result.transactions == 2 * 2 + 2 * 4 + 1


@pytest.mark.slow
def test_a_hundred_emulated_nodes(tmp_path):
    """On this 2-core machine the emulator of 100 nodes runs iterations of several
    seconds: a long failure timeout keeps a starved lease thread from being taken for
    a death."""
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, "-m", "commands.scale.cli", "--nodes", "100", "--iterations", "12",
                           "--kill-at", "6", "--burst", "1", "--iteration-seconds", "2", "--failure-timeout", "10",
                           "--json", str(out)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [result] = json.loads(out.read_text())
    assert result["pipelines"] == 25 and result["errors"] == []
    assert result["to_agreement_s"] is not None and result["to_assignment_s"] is not None
