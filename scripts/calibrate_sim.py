"""Calibrate bamboo-sim's profiles on this machine: time one transformer layer of
each profile's shape with the runtime's own parts (`bamboo.model.builtin` layers, the
AdamW of `bamboo.model.recipe`, `bamboo.transport.swap.SavedTensors`), and write what was
measured, with the conditions, to sim/calibration.json.

One thread, as each worker runs (`bamboo/runtime/worker.py`), float32 on the CPU. Per layer
and microbatch: forward (building the graph, as training does), backward, one AdamW
step over the layer's parameters, and a swap-out of the intermediates a redundant
forward keeps (their bytes too). Two references put the CPU on a scale with a GPU:
the FLOP rate of a plain matrix product of the layer's largest shape, and the
bandwidth of a large copy. `sim/profiles.py` turns these into GPU times with its
stated peak FLOP/s, utilisation and memory bandwidth.

    python scripts/calibrate_sim.py [--repeats 3] [--models gpt2,bert-large] [--out sim/calibration.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bamboo.model import recipe  # noqa: E402
from bamboo.model.builtin import GPTConfig, build_layer  # noqa: E402
from bamboo.transport.swap import SavedTensors  # noqa: E402
from sim.profiles import PROFILES  # noqa: E402
from results import at_least, check_target, write_json  # noqa: E402 (scripts/results.py, beside this file)

OPTIMIZER = SimpleNamespace(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)  # the recipe's defaults' shape


def median_seconds(prepare, repeats: int) -> float:
    """Median wall time of the callable `prepare()` returns, after one untimed
    warm-up; the set-up inside `prepare` stays outside the clock."""
    prepare()()
    times = []
    for _ in range(repeats):
        op = prepare()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_flops(m: int, k: int, n: int, repeats: int) -> float:
    """Floating-point operations per second of one (m x k) @ (k x n) product."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / median_seconds(lambda: lambda: a @ b, repeats)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second moved (read plus write) by a large tensor copy."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: lambda: dst.copy_(src), repeats)


def measure_layer(name: str, repeats: int) -> dict:
    """Per-op times (milliseconds) of one block of profile `name` on one microbatch."""
    p = PROFILES[name]
    cfg = GPTConfig(vocab=8, seq=p.seq, dim=p.hidden, layers=1, heads=max(1, p.hidden // 64), dropout=0.0)
    layer = build_layer(cfg, 1, seed=0)  # index 1: a transformer block
    params = {q.data_ptr() for q in layer.parameters()}
    x = torch.randn(p.microbatch, p.seq, p.hidden, requires_grad=True)
    grad = torch.randn(p.microbatch, p.seq, p.hidden)
    opt = recipe.optimizer(layer, OPTIMIZER)

    def forward():
        return lambda: layer(x)

    def backward():
        out = layer(x)
        return lambda: out.backward(grad)

    def step():
        for q in layer.parameters():
            q.grad = torch.ones_like(q)
        return opt.step

    saved_bytes = []

    def swap():
        saved = SavedTensors(params)
        with saved.recording():
            layer(x)
        saved_bytes.append(saved.nbytes())
        return saved.swap_out

    ms = {op: 1e3 * median_seconds(fn, repeats) for op, fn in
          (("forward", forward), ("backward", backward), ("step", step), ("swap_out", swap))}
    return {"shape": {"hidden": p.hidden, "seq": p.seq, "microbatch": p.microbatch, "heads": cfg.heads},
            "params": sum(q.numel() for q in layer.parameters()),
            "forward_flops": (24 * p.microbatch * p.seq * p.hidden ** 2 + 4 * p.microbatch * p.seq ** 2 * p.hidden),
            "forward_ms": ms["forward"], "backward_ms": ms["backward"], "step_ms": ms["step"],
            "swap_out_ms": ms["swap_out"], "swap_bytes": saved_bytes[-1]}


def conditions(repeats: int) -> dict:
    return {"machine": platform.machine(), "processor": _cpu_name(), "cores": os.cpu_count(), "threads": 1,
            "torch": torch.__version__, "python": platform.python_version(), "dtype": "float32",
            "device": "cpu", "repeats": repeats, "statistic": "median after one warm-up",
            "date": datetime.date.today().isoformat()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="gpt2,bert-large")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "sim", "calibration.json"))
    a = ap.parse_args()
    at_least(ap, [("--repeats", a.repeats, 1)])
    if unknown := [n for n in a.models.split(",") if n not in PROFILES]:
        ap.error(f"--models: unknown {', '.join(map(repr, unknown))} (known: {', '.join(sorted(PROFILES))})")
    check_target(ap, "--out", a.out)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {"conditions": conditions(a.repeats)}
    biggest = max((PROFILES[n] for n in a.models.split(",")), key=lambda p: p.hidden)
    shape = (biggest.microbatch * biggest.seq, biggest.hidden, 4 * biggest.hidden)
    out["reference"] = {"gemm_shape": list(shape), "gemm_flops": gemm_flops(*shape, a.repeats),
                        "copy_bytes_per_s": copy_bandwidth(256 << 20, a.repeats)}
    print(json.dumps(out["conditions"]), file=sys.stderr)
    print(json.dumps(out["reference"]), file=sys.stderr)
    out["layers"] = {}
    for name in a.models.split(","):
        out["layers"][name] = measure_layer(name, a.repeats)
        print(name, json.dumps(out["layers"][name]), file=sys.stderr)
    write_json(a.out, out)
    print(f"wrote {os.path.normpath(a.out)}")


if __name__ == "__main__":
    main()
