"""Memory benchmark: no worker holds the whole model.

Trains a model of 300M+ parameters for a few iterations as the single-process
reference and as a P=4 pipeline with --redundancy off and eager, and prints each
worker's peak RSS over the single process's beside the share of the model's
parameters the worker holds (its stage; with eager, its successor's stage too).
Weights, gradients and AdamW's two moments scale with that share; what does not
is a fixed overhead (interpreter, torch, gloo, the etcd client), measured by the
same runs of the 94K-parameter `tiny` model and subtracted in the last column.

    python scripts/bench_memory.py [--model hf:gpt2-medium] [--seq 64] [--iterations 2]
"""
from __future__ import annotations

import argparse

import torch
from bench_runtime import run
from results import at_least  # scripts/results.py, beside this file

from bamboo.model.api import ModelSource
from bamboo.model.partition import partition


def peaks(args: list[str]) -> dict[int, float]:
    """Peak RSS in MB per node of one run."""
    summary = run(args)[-1]["summary"]
    return {int(n): mb for n, mb in summary["peak_memory_mb"].items()}


def shares(model: str, seq: int, stages: int) -> tuple[list[float], float]:
    """Each stage's parameter count over the whole model's (a tied weight counted
    once, as the single process holds it), and that total."""
    source = ModelSource(model, seed=0, seq=seq)
    costs = source.costs()
    with torch.device("meta"):
        tied = sum(source._build(second).get_parameter(name).numel() for _, _, second, name in source.ties)
    total = sum(costs) - tied
    return [sum(costs[i] for i in r) / total for r in partition(costs, stages)], total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf:gpt2-medium")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=2)
    a = ap.parse_args()
    at_least(ap, [("--seq", a.seq, 1), ("--batch", a.batch, 1), ("--microbatches", a.microbatches, 1),
                  ("--iterations", a.iterations, 1)])
    P = 4
    try:
        share, total = shares(a.model, a.seq, P)  # builds the model's source: an unknown one fails here
    except (ValueError, OSError) as e:
        ap.error(f"--model {a.model}: {e}")
    common = ["--seq", str(a.seq), "--batch", str(a.batch), "--microbatches", str(a.microbatches),
              "--iterations", str(a.iterations)]
    overhead_single = peaks(["--model", "tiny", *common, "--stages", "1", "--pipelines", "1"])[0]
    single = peaks(["--model", a.model, *common, "--stages", "1", "--pipelines", "1"])[0]
    print(f"{a.model}: {total / 1e6:.1f}M parameters, fp32, AdamW; P={P}, D=1, M={a.microbatches}, "
          f"batch={a.batch}, seq={a.seq}, {a.iterations} iterations; peak RSS (ru_maxrss)")
    print(f"single process: {single:8.0f} MB   (tiny model: {overhead_single:.0f} MB of fixed overhead)")
    for mode in ("off", "eager"):
        overhead = peaks(["--model", "tiny", *common, "--stages", str(P), "--redundancy", mode])
        got = peaks(["--model", a.model, *common, "--stages", str(P), "--redundancy", mode])
        print(f"--redundancy {mode}: node  peak MB  /single  params held  (peak-overhead)/(single-overhead)")
        for n in range(P):
            held = share[n] + (share[(n + 1) % P] if mode == "eager" else 0.0)
            scaled = (got[n] - overhead[n]) / (single - overhead_single)
            print(f"{'':18}{n:4} {got[n]:8.0f}  {got[n] / single:7.3f}  {held:11.3f}  {scaled:8.3f}")
        print(f"{'':18}mean {sum(got.values()) / P:8.0f}  {sum(got.values()) / P / single:7.3f}")


if __name__ == "__main__":
    main()
