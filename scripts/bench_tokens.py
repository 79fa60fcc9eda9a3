"""Throughput benchmark: tokens per second of GPT-2 small's shape, fp32 and bf16.

Trains `hf:gpt2` (124M parameters, tied head) as a P=2 pipeline, one process per
core with one torch thread each, alternating --precision fp32 and bf16 for a few
rounds on the same samples, and prints tokens/s (microbatches x batch x seq over
the mean iteration time, warm-up iterations dropped) and the bf16/fp32 ratio.

    python scripts/bench_tokens.py [--rounds 2] [--iterations 6] [--seq 128] [--batch 2]
"""
from __future__ import annotations

import argparse
import statistics

from bench_runtime import run
from results import at_least


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--redundancy", default="eager", choices=("eager", "off"))
    a = ap.parse_args()
    warm = 2
    at_least(ap, (("--rounds", a.rounds, 1), ("--iterations", a.iterations, warm + 1),  # one after the warm-up
                  ("--seq", a.seq, 1), ("--batch", a.batch, 1), ("--microbatches", a.microbatches, 1)))
    common = ["--model", "hf:gpt2", "--stages", "2", "--seq", str(a.seq), "--batch", str(a.batch),
              "--microbatches", str(a.microbatches), "--iterations", str(a.iterations),
              "--redundancy", a.redundancy]
    tokens = a.microbatches * a.batch * a.seq
    rates: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(a.rounds):
        for precision in rates:
            records = run(common + ["--precision", precision])
            seconds = statistics.mean(r["seconds"] for r in records[warm:-1])
            rates[precision].append(tokens / seconds)
    fp32, bf16 = statistics.median(rates["fp32"]), statistics.median(rates["bf16"])
    print(f"hf:gpt2 (124M) P=2 D=1 --redundancy {a.redundancy}, M={a.microbatches} batch={a.batch} seq={a.seq} "
          f"({tokens} tokens/iteration), {a.rounds} rounds alternating, median of means after {warm} warm-up")
    print(f"tokens/s  fp32 {fp32:8.1f}   bf16 {bf16:8.1f}   bf16/fp32 {bf16 / fp32:.3f}")


if __name__ == "__main__":
    main()
