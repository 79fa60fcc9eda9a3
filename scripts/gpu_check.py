"""make gpu-check: the CUDA path, correct and measured.

    python scripts/gpu_check.py [--out out/gpu-check.json] [--quick]

Needs a CUDA machine; on one without, it says so and exits 0. Every run is a
real `bamboo-train` with its workers sharing the GPU(s) (`--share-gpu`, gloo:
GPU tensors staged through pinned host buffers), a node SIGKILLed mid-iteration,
compared with the single-process reference run on the same device in the same
precision (not float64 on the CPU: a CUDA generator draws other dropout masks than
the CPU's from one seed, and attention dropout inside a fused CUDA kernel depends
on the kernel the dtype picks; measured on an H200, 3.7e-3 and 3.2e-4 apart):
the built-in and Hugging Face models, fp32, bf16 and fp16, eager and lazy, and the
swap poison run (every host buffer filled with NaN before its copy: a NaN that
reaches BRC fails it). Then eager/off and lazy/off iteration time and peak CUDA
memory per worker for GPT-2 small's shape. With two GPUs or more, `--transport
nccl` (a GPU per worker) through a SIGKILL, and with four the data-parallel reduce
over NCCL. Exit 1 if a correctness check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from bamboo.model.builtin import FP16_ON_CPU

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}  # relative, against the same device and precision
COMMON = ["--microbatches", "8", "--iterations", "6", "--batch", "2", "--seq", "64", "--seed", "3"]


def train(metrics: str, *args: str, env: dict | None = None) -> tuple[list[dict], dict, str]:
    """Run bamboo-train; its iteration records, its summary and its stderr's tail."""
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress", "--metrics-out", metrics,
                          *args], capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) and out.returncode == 0 else []
    records = [r for r in lines if "summary" not in r]
    summary = next((r["summary"] for r in lines if "summary" in r), {})
    return records, summary, out.stderr.strip().splitlines()[-1] if out.returncode else ""


def precision_env(precision: str) -> dict:
    """--on-cpu: fp16 (a CUDA precision) is let run on the CPU, as the tests do."""
    return {FP16_ON_CPU: "1"} if precision == "fp16" and not torch.cuda.is_available() else {}


def reference(tmp: str, model: str, precision: str) -> list[float]:
    """The single-process run on the device the checked runs use, in their precision."""
    where = [] if torch.cuda.is_available() else ["--devices", "cpu"]
    records, _, error = train(os.path.join(tmp, f"ref-{model}-{precision}.jsonl"), "--model", model, *COMMON,
                              "--stages", "1", "--precision", precision, *where, env=precision_env(precision))
    if error:
        raise SystemExit(f"gpu-check: the reference run failed: {error}")
    return [r["loss"] for r in records]


CASES = [  # name, model, precision, redundancy, extra flags, extra environment
    ("tiny fp32 eager", "tiny", "fp32", "eager", [], {}),
    ("tiny bf16 eager", "tiny", "bf16", "eager", [], {}),
    ("tiny fp32 lazy", "tiny", "fp32", "lazy", [], {}),
    ("tiny fp32 eager, swap poison", "tiny", "fp32", "eager", [], {"BAMBOO_POISON_HOST": "1"}),
    ("gpt2-tiny fp32 eager", "hf:gpt2-tiny", "fp32", "eager", [], {}),
    ("gpt2-tiny bf16 eager", "hf:gpt2-tiny", "bf16", "eager", [], {}),
    ("llama-tiny bf16 lazy", "hf:llama-tiny", "bf16", "lazy", [], {}),
    ("tiny fp16 eager", "tiny", "fp16", "eager", [], {}),  # with the dynamic loss scale
    ("gpt2-tiny fp16 lazy", "hf:gpt2-tiny", "fp16", "lazy", [], {}),
]


def judged(name: str, run: tuple[list[dict], dict, str], ref: list[float], precision: str, killed_node: int) -> dict:
    """One check's row, printed: a run's losses against the reference, and whether
    the node was really killed."""
    records, summary, error = run
    losses = [r["loss"] for r in records]
    worst = max((abs(a - b) / abs(b) for a, b in zip(losses, ref)), default=float("inf"))
    killed = any(e["type"] == "preemption" for r in records for e in r.get("events", []))
    ok = not error and len(losses) == len(ref) and killed and worst <= TOLERANCE[precision]
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max relative loss error {worst:.2e} "
          f"(tolerance {TOLERANCE[precision]:g}), node {killed_node} killed in iteration 3: {killed}"
          + (f" -- {error}" if error else ""), flush=True)
    return {"check": name, "ok": ok, "max_rel_loss_error": worst, "tolerance": TOLERANCE[precision],
            "killed": killed, "peak_cuda_mb": summary.get("peak_cuda_mb"), "error": error}


def correctness(tmp: str, quick: bool, only: str = "") -> list[dict]:
    rows, refs = [], {}
    for name, model, precision, mode, extra, env in CASES[:3] if quick else CASES:
        if only not in name:
            continue
        if (model, precision) not in refs:
            refs[model, precision] = reference(tmp, model, precision)
        run = train(os.path.join(tmp, f"{name.replace(' ', '_')}.jsonl"), "--model", model, *COMMON,
                    "--stages", "4", "--share-gpu", "--precision", precision, "--redundancy", mode,
                    "--preempt", "2@3:12", *extra, env={**env, **precision_env(precision)})
        rows.append(judged(name, run, refs[model, precision], precision, 2))
    if not rows:
        print(f"gpu-check: no correctness check's name holds {only!r}")
        raise SystemExit(2)
    return rows


def nccl_checks(tmp: str, gpus: int) -> list[dict]:
    """--transport nccl, one GPU per worker: P=2 eager and lazy with node 1
    SIGKILLed mid-iteration (its channels aborted, the survivor merges), and with
    four GPUs P=2 D=2 (the data-parallel reduce over NCCL), against the reference."""
    runs = [("nccl P=2 eager", ["--stages", "2", "--redundancy", "eager", "--preempt", "1@3:12"]),
            ("nccl P=2 lazy", ["--stages", "2", "--redundancy", "lazy", "--preempt", "1@3:12"])]
    if gpus >= 4:
        runs.append(("nccl P=2 D=2 eager", ["--stages", "2", "--pipelines", "2", "--redundancy", "eager",
                                            "--preempt", "1@3:12"]))
    ref = reference(tmp, "tiny", "fp32")
    return [judged(name, train(os.path.join(tmp, f"{name.replace(' ', '_')}.jsonl"), "--model", "tiny", *COMMON,
                               "--transport", "nccl", *flags), ref, "fp32", 1)
            for name, flags in runs]


def performance(tmp: str, quick: bool) -> dict:
    """eager/off and lazy/off on GPT-2 small's shape (124M), P=2, fault-free."""
    args = ["--model", "hf:gpt2", "--stages", "2", "--microbatches", "8", "--batch", "4", "--seq", "256",
            "--iterations", "4" if quick else "8", "--precision", "bf16", "--share-gpu"]
    result = {"flags": " ".join(args)}
    for mode in ("off", "eager", "lazy"):
        records, summary, error = train(os.path.join(tmp, f"perf-{mode}.jsonl"), *args, "--redundancy", mode)
        if error:
            result[mode] = {"error": error}
            continue
        seconds = [r["seconds"] for r in records[2:]] or [r["seconds"] for r in records]
        result[mode] = {"iteration_s": statistics.median(seconds), "peak_cuda_mb": summary.get("peak_cuda_mb")}
    base = result.get("off", {})
    for mode in ("eager", "lazy"):
        mine = result.get(mode, {})
        if "iteration_s" in mine and "iteration_s" in base:
            result[f"{mode}/off time"] = round(mine["iteration_s"] / base["iteration_s"], 3)
            result[f"{mode}/off memory"] = round(max(mine["peak_cuda_mb"].values())
                                                 / max(base["peak_cuda_mb"].values()), 3)
    print(json.dumps(result, indent=1), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu-check.json")
    ap.add_argument("--quick", action="store_true", help="three correctness runs and a short timing")
    ap.add_argument("--no-timing", action="store_true", help="the correctness checks alone")
    ap.add_argument("--only", default="", metavar="TEXT", help="the correctness checks whose name holds TEXT")
    ap.add_argument("--on-cpu", action="store_true", help="run the correctness checks on the CPU (tests this script)")
    args = ap.parse_args()
    if args.on_cpu:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            rows = correctness(tmp, args.quick, args.only)
        return 0 if all(r["ok"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("gpu-check: skipped: this machine has no CUDA device (run `make gpu-check` on a GPU host)")
        return 0
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    print(f"gpu-check on {gpus} x {device}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        rows = correctness(tmp, args.quick, args.only)
        perf = {} if args.no_timing else performance(tmp, args.quick)
        nccl = nccl_checks(tmp, gpus) if gpus >= 2 else [{"check": "nccl", "ok": True, "skipped": "one GPU"}]
    rows += [r for r in nccl if "skipped" not in r]
    report = {"device": device, "gpus": gpus, "torch": torch.__version__, "only": args.only,
              "timing": not args.no_timing, "checks": rows, "performance": perf,
              "nccl": nccl}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.out)), delete=False) as f:
        json.dump(report, f, indent=1)
    os.replace(f.name, args.out)
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
