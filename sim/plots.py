"""The PNGs `bamboo-sim --plot DIR` writes: a run's nodes and throughput over time,
and the sweep's value against the preemption rate. Each is written to a temporary
file and renamed, so no half-written plot is left behind."""
from __future__ import annotations

import os
import tempfile

from sim.simulator import STRATEGIES


def _save(fig, path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def plot_run(results: dict[str, dict], directory: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []
    for name, index, label in (("nodes", 1, "nodes"), ("throughput", 2, "samples/s")):
        fig, ax = plt.subplots(figsize=(8, 3))
        for strategy, r in results.items():
            times = [t / 3600 for t, _, _ in r["timeline"]] + [r["hours"]]
            values = [row[index] for row in r["timeline"]]
            ax.step(times, values + values[-1:], where="post", label=strategy)
            if name == "nodes":
                break  # the same nodes for every spot strategy
        ax.set_xlabel("hours")
        ax.set_ylabel(label)
        ax.legend()
        path = os.path.join(directory, f"{name}.png")
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def plot_sweep(rows: list[dict], directory: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in STRATEGIES:
        ax.plot([r["rate"] for r in rows], [r[strategy] for r in rows], marker="o", label=strategy)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([r["rate"] for r in rows], [f"{r['rate']:g}" for r in rows])
    ax.set_xlabel("preemptions per node-hour")
    ax.set_ylabel("value: samples/s per $/h")
    ax.set_title(title)
    ax.legend()
    path = os.path.join(directory, "value-vs-rate.png")
    _save(fig, path)
    plt.close(fig)
    return path
