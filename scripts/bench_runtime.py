"""Runtime benchmark: what eager redundancy costs on real processes, and how long a
preemption pauses training.

Runs bamboo-train with P=2, D=1 (one process per core on a 2-core machine, the
only layout where a bubble is really idle), alternating --redundancy off and
eager, and prints side-by-side ratios: mean iteration time (warm-up iterations
dropped) and peak process memory; then one run with a node SIGKILLed mid-iteration
and its pause (kill to the end of that iteration) against a normal iteration.

    python scripts/bench_runtime.py [--rounds 3] [--iterations 30] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile


def run(args: list[str]) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        subprocess.run([sys.executable, "-m", "bamboo.cli", "--no-progress", "--metrics-out", f.name, *args],
                       check=True, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in open(f.name)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    a = ap.parse_args()
    common = ["--model", "tiny", "--stages", "2", "--microbatches", str(a.microbatches),
              "--iterations", str(a.iterations), "--batch", str(a.batch)]
    warm = 3
    times: dict[str, list[float]] = {"off": [], "eager": []}
    memory: dict[str, list[float]] = {"off": [], "eager": []}
    for _ in range(a.rounds):
        for mode in ("off", "eager"):
            records = run(common + ["--redundancy", mode])
            times[mode].append(statistics.mean(r["seconds"] for r in records[warm:-1]))
            memory[mode].append(max(records[-1]["summary"]["peak_memory_mb"].values()))
    t_off, t_eager = statistics.median(times["off"]), statistics.median(times["eager"])
    m_off, m_eager = statistics.median(memory["off"]), statistics.median(memory["eager"])
    print(f"P=2 D=1 M={a.microbatches} batch={a.batch} tiny, {a.rounds} rounds alternating, median of means")
    print(f"iteration time  off {t_off * 1e3:8.1f} ms   eager {t_eager * 1e3:8.1f} ms   eager/off {t_eager / t_off:.3f}")
    print(f"peak RSS        off {m_off:8.1f} MB   eager {m_eager:8.1f} MB   eager/off {m_eager / m_off:.3f}")
    kill_at = a.iterations // 2
    records = run(common + ["--redundancy", "eager", "--preempt", f"1@{kill_at}:6"])
    pause = next(e["pause_seconds"] for r in records[:-1] for e in r["events"] if e["type"] == "preemption")
    normal = statistics.mean(r["seconds"] for r in records[warm:kill_at])
    after = statistics.mean(r["seconds"] for r in records[kill_at + 1:-1])
    print(f"preemption      pause {pause * 1e3:.1f} ms = {pause / normal:.2f} normal iterations; "
          f"merged iterations after it {after / normal:.2f}x (one node runs both stages)")


if __name__ == "__main__":
    main()
