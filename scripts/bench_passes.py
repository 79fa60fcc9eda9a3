"""One microbatch of the hot path's last stage, pass by pass: Bamboo's split backward
(bamboo/runtime/two_pass.py) against torch.distributed.pipelining's
(`stage_backward_input`, `stage_backward_weight`: what its zero-bubble schedule runs)
and a whole backward, on the same module, input and samples as
scripts/bench_hotpath.py. Whether the compute of a split backward, not the schedule
around it, separates Bamboo from torch's zero-bubble schedule.

One process, one torch thread; the three alternate within each round, in reverse
order every other round; medians over the rounds after the first.

    python scripts/bench_passes.py [--shape small|large] [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("small", "large"), default="large")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first is dropped)")
    os.environ["BAMBOO_BENCH_SHAPE"] = args.shape  # read by bench_hotpath at import (SHAPE_ENV)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    import torch
    torch.set_num_threads(1)
    import bench_hotpath as hot
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from bamboo.model.builtin import token_loss
    from bamboo.runtime.two_pass import input_pass

    layers, ranges, corpus, _ = hot.setup(0)
    first, last = (torch.nn.Sequential(*[layers[i] for i in r]) for r in ranges)
    x, y = corpus.microbatch(0, 0)
    with torch.no_grad():
        h = first(x)
    params = [p for p in last.parameters() if p.requires_grad]

    def forward():
        inp = h.detach().requires_grad_(True)
        return inp, token_loss(last(inp), y) / hot.M

    def timed(backward) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        inp, loss = forward()
        t1 = time.perf_counter()
        weights = backward(inp, loss)
        t2 = time.perf_counter()
        weights()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def ours(inp, loss):
        return input_pass(loss, None, inp, params)[1].weight_pass

    def torchs(inp, loss):
        _, groups = stage_backward_input([loss], None, [inp], iter(params))
        return lambda: stage_backward_weight(iter(params), groups)

    def whole(inp, loss):
        loss.backward()
        return lambda: None

    kinds = {"bamboo": ours, "torch": torchs, "whole": whole}
    runs: dict[str, list] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            last.zero_grad(set_to_none=False)
            runs[k].append(timed(kinds[k]))
    print(f"{hot.MODEL} ({args.shape}: dim {hot.CFG.dim}, {hot.CFG.layers} blocks, seq {hot.CFG.seq}, batch "
          f"{hot.BATCH}), the last of P={hot.P} stages (layers {ranges[-1].start}..{ranges[-1].stop - 1}), one "
          f"microbatch, 1 torch thread, torch {torch.__version__}; medians of rounds 2..{args.rounds}:")
    for k, v in runs.items():
        f, i, w = (statistics.median(c) * 1000 for c in zip(*v[1:]))
        passes = f"backward {i:8.1f}" + " " * 24 if k == "whole" else f"input pass {i:8.1f}   weight pass {w:8.1f}"
        print(f"  {k:7s} forward {f:8.1f} ms   {passes}   total {f + i + w:8.1f}")


if __name__ == "__main__":
    main()
