"""`bamboo-plot METRICS.jsonl -o run.png`, and `bamboo-train --plot PNG`: one figure
of a run that a person can look at.

Three panels share a wall-clock axis (the iterations' cumulative `seconds`, so
pauses show as gaps): training and validation loss, samples/s, live nodes.
Preemptions, failovers, reconfigurations (and redos, notices) are vertical lines
across all three, one style per kind, named in the legend. Matplotlib draws on
an Agg canvas (no screen, no global backend); the PNG is written to a temp file
beside the target and renamed, so no reader sees half an image.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# Event type -> (legend label, colour, line style); drawn in this order.
EVENT_STYLES = {
    "preemption": ("preemption (node killed)", "tab:red", "-"),
    "failover": ("failover (stage taken over)", "tab:orange", "--"),
    "reconfigure": ("reconfiguration (new epoch)", "tab:green", ":"),
    "redo": ("redo (iteration abandoned)", "tab:purple", "-."),
    "notice": ("preemption notice", "tab:brown", (0, (1, 3))),
}
FIGSIZE, DPI = (10.0, 8.0), 100   # a 1000 x 800 pixel PNG
REQUIRED = ("iteration", "loss", "samples", "seconds", "nodes")


class BadInput(ValueError):
    """What is wrong with a metrics file or an output path, in one line."""


def read_metrics(path: str) -> list[dict]:
    """The iteration records of a metrics file (the summary line left out)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path} line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise BadInput(f"{path} line {number}: not a JSON object")
        if "summary" not in record:
            _check_record(record, f"{path} line {number}")
            records.append(record)
    if not records:
        raise BadInput(f"{path}: no iteration records")
    return records


def _check_record(record: dict, where: str) -> None:
    for key in REQUIRED:
        if key not in record:
            raise BadInput(f"{where}: an iteration record without {key!r}")
        if isinstance(record[key], bool) or not isinstance(record[key], (int, float)):
            raise BadInput(f"{where}: {key!r} is not a number")
    if not 0 <= record["seconds"] < float("inf"):  # NaN fails too; a NaN loss (diverged) is drawn as a gap
        raise BadInput(f"{where}: 'seconds' is {record['seconds']}, not a duration")
    if not 0 <= record["iteration"] < float("inf") or record["iteration"] != int(record["iteration"]):
        raise BadInput(f"{where}: 'iteration' is {record['iteration']}, not an iteration number")
    val_loss = record.get("val_loss")
    if val_loss is not None and (isinstance(val_loss, bool) or not isinstance(val_loss, (int, float))):
        raise BadInput(f"{where}: 'val_loss' is not a number")
    events = record.get("events", [])
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise BadInput(f"{where}: 'events' is not a list of objects")


def timeline(records: list[dict]) -> list[float]:
    """When each iteration ended, in seconds since the launch."""
    ends, total = [], 0.0
    for record in records:
        total += record["seconds"]
        ends.append(total)
    return ends


def event_marks(records: list[dict]) -> list[tuple[float, str]]:
    """(time, type) of each event worth a line. A preemption is drawn when the node
    was killed (`pause_seconds` before its iteration was recorded, kept within the
    iteration's span: a worker may start an iteration before the launcher recorded
    the one before), a reconfiguration
    at the boundary where its epoch began, anything else when its iteration ended.
    Epoch 0 is the job's first configuration, not a change, and is left out."""
    marks, start = [], 0.0
    for record, end in zip(records, timeline(records)):
        for event in record.get("events", []):
            kind = event.get("type")
            if kind not in EVENT_STYLES or (kind == "reconfigure" and event.get("epoch") == 0):
                continue
            if kind == "preemption":
                at = min(end, max(start, end - event.get("pause_seconds", 0.0)))
            else:
                at = start if kind == "reconfigure" else end
            marks.append((at, kind))
        start = end
    return marks


def title_of(records: list[dict], marks: list[tuple[float, str]]) -> str:
    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'' if n == 1 else 's'}"
    kinds = [k for _, k in marks]
    return (f"{count(len(records), 'iteration')}, {count(sum(r['samples'] for r in records), 'sample')} in "
            f"{timeline(records)[-1]:.1f} s; {count(kinds.count('preemption'), 'preemption')}, "
            f"{count(kinds.count('failover'), 'failover')}, {count(kinds.count('reconfigure'), 'reconfiguration')}")


def figure(records: list[dict], title: str | None = None):
    """The run's figure (a matplotlib Figure on an Agg canvas): loss, samples/s and
    live nodes against wall-clock seconds, the events marked on every panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    loss_ax, rate_ax, nodes_ax = fig.subplots(3, 1, sharex=True, height_ratios=(2, 1, 1))
    ends = timeline(records)
    _plot_loss(loss_ax, records, ends)
    rate_ax.plot(ends, [r["samples"] / r["seconds"] if r["seconds"] else 0.0 for r in records],
                 marker=".", color="tab:blue")
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_ylim(bottom=0)
    nodes_ax.step(ends, [r["nodes"] for r in records], where="pre", color="tab:gray")
    nodes_ax.set_ylabel("live nodes")
    nodes_ax.set_ylim(0, max(r["nodes"] for r in records) + 1)
    nodes_ax.yaxis.get_major_locator().set_params(integer=True)
    nodes_ax.set_xlabel("wall-clock seconds since the launch (the first iteration's time includes the start-up)")
    marks = event_marks(records)
    for at, kind in marks:
        _, colour, style = EVENT_STYLES[kind]
        for ax in (loss_ax, rate_ax, nodes_ax):
            ax.axvline(at, color=colour, linestyle=style, linewidth=1.2, gid=f"event:{kind}")
    present = [kind for kind in EVENT_STYLES if any(k == kind for _, k in marks)]
    if present:
        handles = [Line2D([], [], color=EVENT_STYLES[k][1], linestyle=EVENT_STYLES[k][2], label=EVENT_STYLES[k][0])
                   for k in present]
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title or title_of(records, marks), fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _plot_loss(ax, records: list[dict], ends: list[float]) -> None:
    ax.plot(ends, [r["loss"] for r in records], marker=".", color="tab:blue", label="training loss")
    validated = [(end, r["val_loss"]) for r, end in zip(records, ends) if r.get("val_loss") is not None]
    if validated:
        ax.plot(*zip(*validated), marker="o", color="tab:olive", label="validation loss")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)


def save_png(fig, path: str) -> None:
    """Write `fig` to `path` whole or not at all."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".png.tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def plot_run(records: list[dict], path: str, title: str | None = None):
    """Draw the figure of `records`, write it to `path` and return it."""
    fig = figure(records, title)
    save_png(fig, path)
    return fig


def check_output(path: str, flag: str = "-o") -> None:
    """Fail before any work if `path`'s directory cannot take the file."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path!r}: is a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp"):
            pass
    except OSError as e:
        raise BadInput(f"{flag} {path!r}: cannot write there ({e.strerror or e})") from None


class PlotSink:
    """`bamboo-train --plot`: keeps the records as they are written and draws them
    once the metrics close (after an error too, from what finished)."""

    def __init__(self, path: str):
        self.path, self.records = path, []

    def add(self, record: dict) -> None:
        if "summary" not in record:
            self.records.append(record)

    def close(self) -> None:
        if self.records:  # nothing ran: no figure, like no metrics file
            plot_run(self.records, self.path)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"bamboo-plot: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="bamboo-plot", description="Plot a bamboo-train metrics file (--metrics-out) as one PNG.")
    p.add_argument("metrics", metavar="METRICS.jsonl")
    p.add_argument("-o", "--output", metavar="PNG", help="where the figure goes (default: METRICS with .png)")
    p.add_argument("--title", help="the figure's title (default: iterations, samples, time and event counts)")
    args = p.parse_args(argv)
    output = args.output or os.path.splitext(args.metrics)[0] + ".png"
    try:
        records = read_metrics(args.metrics)
        if os.path.abspath(output) == os.path.abspath(args.metrics):
            raise BadInput(f"-o {output!r}: is the metrics file itself")
        check_output(output)
        plot_run(records, output, args.title)
    except BadInput as e:
        print(f"bamboo-plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk filled up while writing, say: the temp file is gone, the target untouched
        print(f"bamboo-plot: error: -o {output!r}: cannot write it ({e.strerror or e})", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
