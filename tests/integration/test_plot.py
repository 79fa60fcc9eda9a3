"""A run a person can look at: `bamboo-train --plot/--tensorboard` and `bamboo-plot`,
on the metrics of real runs.

One run with agents (`--local-nodes 3`, node 1 SIGKILLed in iteration 2: a
preemption, a failover, then a reconfiguration that brings the standby node in)
and one single-process run feed every check: the PNGs read back as whole images,
the figure's lines and event marks against the metrics file, the TensorBoard
scalars against the file's values.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from commands.train import plot
from tests.training import bamboo_train

WIDTH, HEIGHT = 1000, 800  # plot.FIGSIZE at plot.DPI
AGENTS = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--iterations", "5", "--local-nodes", "3",
          "--preempt", "1@2:5", "--max-stages-per-node", "1", "--surplus", "keep"]
SINGLE = ["--model", "tiny", "--stages", "1", "--pipelines", "1", "--microbatches", "4", "--iterations", "3"]


def _run(tmp, args):
    out, records = bamboo_train(tmp / "metrics.jsonl", *args, "--plot", str(tmp / "run.png"),
                                "--tensorboard", str(tmp / "tb"))
    return {"dir": tmp, "records": records, "stderr": out.stderr}


@pytest.fixture(scope="module")
def agents_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("agents"), AGENTS)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), SINGLE)


def expected_marks(records):
    """Where each kind of event should be drawn, from the metrics alone: a
    preemption `pause_seconds` before its iteration's end (within the iteration), a
    reconfiguration after epoch 0 at its iteration's start, a failover at its end."""
    marks, start = {}, 0.0
    for r in records:
        end = start + r["seconds"]
        for e in r["events"]:
            if e["type"] == "preemption":
                marks.setdefault("preemption", []).append(min(end, max(start, end - e["pause_seconds"])))
            elif e["type"] == "failover":
                marks.setdefault("failover", []).append(end)
            elif e["type"] == "reconfigure" and e["epoch"] > 0:
                marks.setdefault("reconfigure", []).append(start)
        start = end
    return marks


def drawn_marks(ax):
    marks = {}
    for line in ax.get_lines():
        gid = line.get_gid() or ""
        if gid.startswith("event:"):
            xs = line.get_xdata()
            assert xs[0] == xs[1]  # vertical
            marks.setdefault(gid.removeprefix("event:"), []).append(xs[0])
    return marks


def assert_whole_png(path):
    image = imread(str(path))
    assert image.shape == (HEIGHT, WIDTH, 4)
    assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.slow
def test_the_agents_run_had_every_kind_of_event(agents_run):
    kinds = {e["type"] for r in agents_run["records"] for e in r["events"]}
    assert {"preemption", "failover", "reconfigure"} <= kinds
    assert set(expected_marks(agents_run["records"])) == {"preemption", "failover", "reconfigure"}


@pytest.mark.parametrize("run", [pytest.param("agents_run", marks=pytest.mark.slow), "single_run"])
def test_train_plot_writes_a_whole_png(request, run):
    assert_whole_png(request.getfixturevalue(run)["dir"] / "run.png")


@pytest.mark.slow
def test_figure_has_the_panels_and_the_events_where_the_metrics_put_them(agents_run):
    records = agents_run["records"]
    fig = plot.figure(records)
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["loss", "samples/s", "live nodes"]
    loss = axes[0].get_lines()[0]
    assert loss.get_label() == "training loss"
    assert list(loss.get_ydata()) == [r["loss"] for r in records]
    assert list(loss.get_xdata()) == pytest.approx(np.cumsum([r["seconds"] for r in records]))
    rate = axes[1].get_lines()[0].get_ydata()
    assert list(rate) == pytest.approx([r["samples"] / r["seconds"] for r in records])
    assert list(axes[2].get_lines()[0].get_ydata()) == [r["nodes"] for r in records]
    want = expected_marks(records)
    for ax in axes:
        got = drawn_marks(ax)
        assert set(got) == set(want)
        for kind in want:
            assert sorted(got[kind]) == pytest.approx(sorted(want[kind]))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [plot.EVENT_STYLES[k][0] for k in ("preemption", "failover", "reconfigure")]
    assert "validation loss" not in [line.get_label() for line in axes[0].get_lines()]


def test_bamboo_plot_draws_validation_loss_when_records_have_it(single_run, tmp_path, capsys):
    records = [dict(r) for r in single_run["records"]]
    for r in records[::2]:
        r["val_loss"] = r["loss"] + 0.25
    metrics = tmp_path / "with-val.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + json.dumps({"summary": {}}) + "\n")
    assert plot.main([str(metrics), "-o", str(tmp_path / "val.png")]) == 0
    assert_whole_png(tmp_path / "val.png")
    lines = {line.get_label(): line for line in plot.figure(plot.read_metrics(str(metrics))).axes[0].get_lines()}
    assert list(lines["validation loss"].get_ydata()) == [r["loss"] + 0.25 for r in records[::2]]


def test_bamboo_plot_command_on_a_real_metrics_file(single_run, tmp_path):
    out = subprocess.run([sys.executable, "-m", "commands.train.plot", str(single_run["dir"] / "metrics.jsonl"),
                          "-o", str(tmp_path / "figs" / "run.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert_whole_png(tmp_path / "figs" / "run.png")


def read_board(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(directory))
    board.Reload()
    return board


@pytest.mark.parametrize("run", [pytest.param("agents_run", marks=pytest.mark.slow), "single_run"])
def test_tensorboard_scalars_equal_the_metrics(request, run):
    result = request.getfixturevalue(run)
    records, board = result["records"], read_board(result["dir"] / "tb")
    for tag, key in (("loss", "loss"), ("nodes", "nodes"), ("seconds", "seconds")):
        got = [(s.step, s.value) for s in board.Scalars(tag)]
        assert got == [(r["iteration"], float(np.float32(r[key]))) for r in records], tag
    rates = [s.value for s in board.Scalars("samples_per_second")]
    assert rates == pytest.approx([r["samples"] / r["seconds"] for r in records], rel=1e-6)
    assert "val_loss" not in board.Tags()["scalars"]


@pytest.mark.slow
def test_tensorboard_counts_the_events_per_iteration(agents_run):
    records, board = agents_run["records"], read_board(agents_run["dir"] / "tb")
    for kind in ("preemption", "failover", "reconfigure"):
        want = {r["iteration"]: sum(e["type"] == kind for e in r["events"]) for r in records}
        got = {s.step: s.value for s in board.Scalars(f"events/{kind}")}
        assert got == {it: n for it, n in want.items() if n}, kind


def test_tensorboard_shows_an_iteration_before_the_run_ends(tmp_path):
    """Live: each record is on disk once written, with the writer still open."""
    from commands.train.board import Board
    board = Board(str(tmp_path / "tb"))
    record = {"iteration": 0, "loss": 2.5, "samples": 8, "seconds": 0.5, "nodes": 2, "val_loss": 2.75,
              "events": [{"type": "preemption", "node": 1, "pause_seconds": 0.1}]}
    try:
        board.add(record)
        seen = read_board(tmp_path / "tb")
        assert [(s.step, s.value) for s in seen.Scalars("loss")] == [(0, 2.5)]
        assert [(s.step, s.value) for s in seen.Scalars("val_loss")] == [(0, 2.75)]
        assert [s.value for s in seen.Scalars("events/preemption")] == [1]
    finally:
        board.close()


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bamboo-plot: error: "), err
    return err[0]


@pytest.mark.parametrize("content,problem", [
    (None, "cannot read it"),
    ('{"iteration": 0, "loss": 1.0, "samples": 8, "seconds": 0.5, "nodes": 2, "events": []}\nnot json\n',
     "line 2: not JSON"),
    ('{"summary": {"iterations": 0}}\n', "no iteration records"),
    ('{"iteration": 0, "samples": 8, "seconds": 0.5, "nodes": 2}\n', "line 1: an iteration record without 'loss'"),
    ('[1, 2]\n', "line 1: not a JSON object"),
    ('{"iteration": 0, "loss": 1.0, "samples": 8, "seconds": 0.5, "nodes": 2, "val_loss": "x"}\n',
     "line 1: 'val_loss' is not a number"),
    ('{"iteration": 0, "loss": 1.0, "samples": 8, "seconds": NaN, "nodes": 2}\n', "'seconds' is nan, not a duration"),
    ('{"iteration": 0, "loss": 1.0, "samples": 8, "seconds": -1, "nodes": 2}\n', "'seconds' is -1, not a duration"),
    ('{"iteration": 1.5, "loss": 1.0, "samples": 8, "seconds": 1, "nodes": 2}\n', "'iteration' is 1.5"),
    ('{"iteration": NaN, "loss": 1.0, "samples": 8, "seconds": 1, "nodes": 2}\n', "'iteration' is nan"),
])
def test_bad_metrics_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, content, problem):
    metrics = tmp_path / "m.jsonl"
    if content is not None:
        metrics.write_text(content)
    before = sorted(tmp_path.iterdir())
    assert plot.main([str(metrics), "-o", str(tmp_path / "out" / "run.png")]) == 2
    line = _one_line(capsys)
    assert problem in line and str(metrics) in line
    assert sorted(tmp_path.iterdir()) == before


def test_an_unwritable_output_exits_2_with_one_line(single_run, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert plot.main([str(single_run["dir"] / "metrics.jsonl"), "-o", str(blocker / "run.png")]) == 2
    assert "cannot write there" in _one_line(capsys)
    assert plot.main([str(single_run["dir"] / "metrics.jsonl"), "-o", str(tmp_path)]) == 2
    assert "is a directory" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_bad_input_from_the_command_has_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "commands.train.plot", str(tmp_path / "absent.jsonl")],
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "absent.jsonl: cannot read it" in lines[0], out.stderr


@pytest.mark.parametrize("flag,target,message", [
    ("--plot", "a-file/run.png", "cannot write there"),
    ("--plot", ".", "is a directory"),
    ("--tensorboard", "a-file", "is a file, not a directory"),
    ("--tensorboard", "a-file/tb", "cannot write there"),
])
def test_train_checks_plot_and_tensorboard_paths_before_it_starts(tmp_path, capsys, flag, target, message):
    import signal

    from commands.train.cli import main
    (tmp_path / "a-file").write_text("")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(["--no-progress", "--iterations", "1", "--stages", "2", flag, str(tmp_path / target)])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0] and flag in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_diverged_loss_is_drawn_not_refused(tmp_path):
    """A NaN loss is what a diverged run writes: the plot shows it (a gap), unlike
    a NaN duration, which has no place on the time axis."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(f'{{"iteration": {i}, "loss": {"NaN" if i == 2 else 2.0 - i / 10}, "samples": 8, '
                               f'"seconds": 0.5, "nodes": 2}}\n' for i in range(4)))
    out = tmp_path / "run.png"
    assert plot.main([str(metrics), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
