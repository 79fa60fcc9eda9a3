"""Timeline pictures of one simulated iteration: a PNG and a plain-text view.

One row per node. Normal forward/backward, redundant forward (FRC) and backward
(BRC), swaps, optimizer work and messages each get their own colour (PNG) or
letter (text), so a reader sees where the bubbles are and what fills them.
"""
from __future__ import annotations

import os
import tempfile

from schedules.timing.engine import Report
from schedules.ir import Instr, Op

# kind -> (letter for the text view, colour for the PNG, legend label)
KINDS = {
    "F": ("F", "#4C78A8", "forward"),
    "B": ("B", "#54A24B", "backward"),
    "FRC": ("f", "#F58518", "forward, redundant (FRC)"),
    "BRC": ("b", "#E45756", "backward, redundant (BRC)"),
    "swap": ("s", "#9D9D9D", "swap out / in"),
    "step": ("o", "#B279A2", "reduce / optimizer / sync"),
    "other": ("l", "#BAB0AC", "load"),
}
MESSAGE_COLOURS = {Op.SEND_ACT: "#1F4E79", Op.SEND_GRAD: "#2E7D32", Op.SEND_SYNC: "#7B3F99"}


def kind(ins: Instr) -> str:
    if ins.op is Op.FORWARD:
        return "FRC" if ins.redundant else "F"
    if ins.op is Op.BACKWARD:
        return "BRC" if ins.redundant else "B"
    if ins.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):  # a split backward (early_grads.py)
        return "B"
    if ins.op in (Op.SWAP_IN, Op.SWAP_OUT):
        return "swap"
    if ins.op in (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP, Op.SEND_SYNC, Op.RECV_SYNC):
        return "step"
    return "other"


def text_timeline(report: Report, width: int = 100, title: str = "") -> str:
    """Each column is makespan/width time; a cell shows what ran longest in it."""
    makespan = report.makespan or 1.0
    scale = width / makespan
    nodes = sorted(report.busy)
    rows = {n: [" "] * width for n in nodes}
    fill = {n: [0.0] * width for n in nodes}
    for span in report.spans:
        if span.node not in rows or span.end <= span.start:
            continue
        letter = KINDS[kind(span.instr)][0]
        c0, c1 = span.start * scale, span.end * scale
        for col in range(int(c0), min(width, int(c1 - 1e-9) + 1)):
            covered = min(c1, col + 1) - max(c0, col)
            if covered > fill[span.node][col]:
                fill[span.node][col], rows[span.node][col] = covered, letter
    lines = [title] if title else []
    for n in nodes:
        row = "".join(c if c != " " else "." for c in rows[n])
        lines.append(f"node {n:>2} |{row}| idle {report.bubble[n]:5.1%}")
    legend = "  ".join(f"{v[0]}={v[2]}" for v in KINDS.values())
    lines.append(f"makespan {report.makespan:.2f}   .=idle  {legend}")
    return "\n".join(lines)


def render_png(report: Report, path: str, title: str = "", dead: tuple[int, float] | None = None) -> None:
    """Write the timeline to `path` (atomically: a temp file, then a rename)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    nodes = sorted(set(report.busy) | ({dead[0]} if dead else set()))
    row = {n: i for i, n in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(max(8.0, report.makespan * 0.35), 0.6 * len(nodes) + 1.6))
    for span in report.spans:
        if span.end <= span.start or span.node not in row:
            continue
        k = kind(span.instr)
        ax.broken_barh([(span.start, span.end - span.start)], (row[span.node] - 0.4, 0.8),
                       facecolors=KINDS[k][1], edgecolors="white", linewidth=0.5)
        if span.instr.mb >= 0 and k in ("F", "B", "FRC", "BRC"):
            ax.text((span.start + span.end) / 2, row[span.node], str(span.instr.mb),
                    ha="center", va="center", fontsize=6, color="white")
    for m in report.messages:
        if m.src in row and m.dst in row:
            ax.annotate("", xy=(m.received, row[m.dst]), xytext=(m.sent, row[m.src]),
                        arrowprops=dict(arrowstyle="-", color=MESSAGE_COLOURS[m.instr.op],
                                        alpha=0.25, linewidth=0.6))
    if dead:
        ax.plot([dead[1]], [row[dead[0]]], marker="X", color="black", markersize=12)
    ax.set_yticks(range(len(nodes)), [f"node {n}" for n in nodes])
    ax.invert_yaxis()
    ax.set_xlabel("simulated time")
    ax.set_title(title or "one iteration")
    handles = [Patch(color=v[1], label=v[2]) for v in KINDS.values()]
    handles += [Patch(color=c, label=op.value.replace("send_", "message: ")) for op, c in MESSAGE_COLOURS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, fontsize=7)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
