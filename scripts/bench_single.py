"""One device: `bamboo-train --stages 1` against a plain PyTorch training loop of the
same model, tokens/s and peak memory side by side.

Bamboo runs as users run it: `python -m commands.train.cli --stages 1 ...`, one
process (commands/train/single.py). The bare loop, another process of this script,
builds `transformers`' AutoModelForCausalLM from the same config, copies into it
the weights Bamboo starts from (layer i from (seed, i)), and trains it with
the same recipe (bamboo/model/recipe.py: fused AdamW, decay on matrices, the
learning rate of each iteration), the same samples (Corpus.microbatch(it, g)),
batch, microbatches, precision (autocast) and device, one torch thread, reading
the iteration's losses once at its end. Dropout is 0 in the model's config: the
bare loop has no per-microbatch dropout seeds, and the losses must agree.

tokens/s: tokens per iteration over the steady period of iteration ends on the
training process's own clock (the first --warm iterations dropped). Peak memory:
CUDA, torch.cuda.max_memory_allocated in the training process; CPU, that
process's peak RSS (ru_maxrss from wait4). The two sides alternate within each
round, in reverse order every other round; ratio = bamboo/bare tokens/s, the
geometric mean of the rounds' own ratios with a 95% interval.

    python scripts/bench_single.py [--json FILE] [--rounds 3] [--model hf:gpt2-tiny] [--device cpu|cuda]
                                   [--precision bf16] [--seq 128] [--batch 8] [--microbatches 4]
                                   [--iterations 20] [--warm 3] [--check 3] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from results import at_least, check_target, interval, write_json  # scripts/results.py, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
SIDES = ("bamboo", "bare")
DROPOUTS = {"gpt2": ("embd_pdrop", "attn_pdrop", "resid_pdrop"), "llama": ("attention_dropout",)}
# Losses of the first --check iterations must agree this closely (relative): the two
# sides run the same modules in the same order, so they agree to rounding.
RTOL = {"fp32": 1e-5, "bf16": 1e-3}


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """A bad argument is one line and status 2."""
        self.exit(2, f"bench_single.py: error: {message}\n")


def parse(argv=None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="also write the results here (a temp file, then a rename)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds: each runs both sides once")
    ap.add_argument("--model", default="hf:gpt2-tiny", help="a Hugging Face size of bamboo/model/hf.py, hf:NAME")
    ap.add_argument("--model-config", metavar="FILE.json", help="a GPT-2 or Llama config.json instead of --model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="autocast of both sides")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=20, help="per run")
    ap.add_argument("--warm", type=int, default=3, help="iterations dropped at the start of each run")
    ap.add_argument("--check", type=int, default=3, help="iterations whose losses are compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--role", choices=("bare",), help=argparse.SUPPRESS)  # the bare loop's process
    ap.add_argument("--job-config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role:
        return a
    check_target(ap, "--json", a.json)
    if a.model_config and a.model != "hf:gpt2-tiny":
        ap.error("--model and --model-config: the benchmark's model is one or the other")
    at_least(ap, (("--seq", a.seq, 1), ("--batch", a.batch, 1), ("--microbatches", a.microbatches, 1),
                  ("--seed", a.seed, 0)))
    if not a.model_config and not a.model.startswith("hf:"):
        ap.error(f"--model {a.model!r}: expected hf:NAME, a Hugging Face size of bamboo/model/hf.py")
    if a.rounds < 1 or a.warm < 1 or a.iterations < a.warm + 2 or not 1 <= a.check <= a.iterations:
        ap.error(f"need --rounds >= 1, --warm >= 1, --iterations >= --warm + 2 and 1 <= --check <= --iterations "
                 f"(got {a.rounds}, {a.warm}, {a.iterations}, {a.check})")
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device on this machine")
    a.config_text = model_config(ap, a)
    a.cfg = job_config(ap, a)
    return a


def model_config(ap: Parser, a) -> str:
    """The model's config.json text with every dropout at 0."""
    from bamboo.model.hf import NAMED
    if a.model_config:
        try:
            with open(a.model_config) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--model-config {a.model_config}: {e}")
    elif a.model.removeprefix("hf:") in NAMED:
        raw = dict(NAMED[a.model.removeprefix("hf:")])
    else:
        ap.error(f"--model {a.model!r}: unknown size (known: hf:{', hf:'.join(NAMED)})")
    if not isinstance(raw, dict):
        ap.error("--model-config: expected a JSON object")
    return json.dumps({**raw, **{k: 0.0 for k in DROPOUTS.get(raw.get("model_type"), ())}})


def bamboo_args(a, config_file: str) -> list[str]:
    """bamboo-train's flags for this run (the metrics file aside)."""
    return ["--no-progress", "--stages", "1", "--model-config", config_file, "--seq", str(a.seq),
            "--batch", str(a.batch), "--microbatches", str(a.microbatches), "--iterations", str(a.iterations),
            "--seed", str(a.seed), "--precision", a.precision, "--devices", "cpu" if a.device == "cpu" else "0",
            "--warmup", "2", "--lr-schedule", "cosine", "--min-lr", "1e-4"]


def job_config(ap: Parser, a):
    """The JobConfig bamboo-train makes of those flags, by its own parser: what the
    bare loop builds its model, samples and recipe from."""
    from commands.train.cli import config_from_args
    from commands.train.flags import build_parser
    from bamboo.transport import devices
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(a.config_text)
        f.flush()
        try:
            cfg = config_from_args(build_parser().parse_args(bamboo_args(a, f.name)))
            devices.check_flags(",".join(cfg.devices.names), True, "gloo", 1)
        except ValueError as e:
            ap.error(str(e))
    return cfg


# -- the two sides, each in a process of its own ---------------------------------------
def run_child(cmd: list[str], what: str) -> float:
    """Run `cmd`; return its peak RSS in MB (wait4's, of that process alone)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{err.read().decode()[-3000:]}")
    return usage.ru_maxrss / 1024


def run_bamboo(a, config_file: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        rss = run_child([sys.executable, "-m", "commands.train.cli", *bamboo_args(a, config_file),
                         "--metrics-out", f"{d}/m.jsonl"], "bamboo-train")
        records = [json.loads(line) for line in open(f"{d}/m.jsonl")]
    summary, records = records[-1]["summary"], records[:-1]
    cuda = summary.get("peak_cuda_mb", {}).get("0")
    return {"seconds": [r["seconds"] for r in records], "losses": [r["loss"] for r in records],
            "peak_memory_mb": cuda if a.device == "cuda" else rss, "peak_rss_mb": rss}


def run_bare(a, job_file: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        rss = run_child([sys.executable, os.path.abspath(__file__), "--role", "bare", "--job-config", job_file,
                         "--out", f"{d}/out.json"], "the bare loop")
        out = json.load(open(f"{d}/out.json"))
    ends = out["ends"]
    return {"seconds": [round(t - s, 4) for s, t in zip([out["start"]] + ends, ends)], "losses": out["losses"],
            "peak_memory_mb": out["cuda_mb"] if a.device == "cuda" else rss, "peak_rss_mb": rss}


def bare_model(source, device):
    """AutoModelForCausalLM of `source`'s config holding the weights Bamboo starts
    from, copied in one layer at a time (no second copy of the model)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(source.config, attn_implementation="sdpa", dtype=source.dtype)
    model.config.use_cache = False  # training: no key/value cache
    loaded = set()
    for i in range(source.count):
        state = {source.hf.hf_key(i, k): v for k, v in source.layer(i).state_dict().items()}
        with torch.no_grad():
            _, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        loaded |= set(state)
    assert loaded == set(model.state_dict()), set(model.state_dict()) ^ loaded
    return model.to(device).train()


def bare_loop(a) -> None:
    """The plain loop: what a user writes around `transformers` for one device."""
    import torch
    import torch.nn.functional as F

    from bamboo.control.config import JobConfig, Precision
    from bamboo.data.corpus import corpus_of
    from bamboo.model import recipe
    from bamboo.model.api import ModelSource
    from bamboo.transport import devices
    torch.set_num_threads(1)  # as bamboo's single-process run
    cfg = JobConfig.from_dict(json.load(open(a.job_config)))
    device = devices.claim(0, cfg.devices.names, share=True)
    source = ModelSource.of(cfg.model)
    model = bare_model(source, device)
    corpus, vocab = corpus_of(cfg, source.seq), source.config.vocab_size
    opt = recipe.optimizer(model, cfg.recipe)
    autocast = torch.bfloat16 if cfg.recipe.precision == Precision.BF16 else None
    start, ends, losses = time.monotonic(), [], []
    for it in range(cfg.schedule.iterations):
        model.zero_grad(set_to_none=True)
        mine = []
        for g in range(cfg.schedule.microbatches):
            x, y = (t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
                    for t in corpus.microbatch(it, g))
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
            (loss / cfg.schedule.microbatches).backward()
            mine.append(loss.detach())
        recipe.set_learning_rate(opt, recipe.learning_rate(cfg, it))
        opt.step()
        values = torch.stack(mine).tolist()  # the iteration's one host synchronisation
        losses.append(sum(values) / cfg.schedule.microbatches)
        ends.append(time.monotonic())
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    with open(a.out, "w") as f:
        json.dump({"start": start, "ends": ends, "losses": losses, "cuda_mb": cuda}, f)


# -- the comparison --------------------------------------------------------------------
def tokens_per_s(run: dict, a) -> float:
    """Tokens per iteration over the mean period after the warm-up."""
    steady = run["seconds"][a.warm:]
    return a.microbatches * a.batch * a.seq * len(steady) / sum(steady)


def compare_losses(runs: dict, a) -> tuple[float, bool]:
    """The first --check iterations' losses of every run against round 1's bamboo run:
    the largest relative difference, and whether it is within the precision's tolerance."""
    want = runs["bamboo"][0]["losses"][:a.check]
    worst = max(abs(r["losses"][i] - want[i]) / abs(want[i]) for s in SIDES for r in runs[s] for i in range(a.check))
    print(f"\nlosses of the first {a.check} iterations (round 1); every round checked, rtol {RTOL[a.precision]:g}")
    for i in range(a.check):
        print(f"  iteration {i}: " + "   ".join(f"{s} {runs[s][0]['losses'][i]:.6f}" for s in SIDES))
    match = worst <= RTOL[a.precision]
    print(f"  largest relative difference: {worst:.2e}: {'the same math' if match else 'DIFFERENT'}")
    return worst, match


def parameters(a) -> dict:
    import torch
    import transformers

    from bamboo.model.hf import load_config
    cfg = a.cfg
    r = cfg.recipe
    with torch.device("meta"):  # a tied weight counted once
        params = transformers.AutoModelForCausalLM.from_config(load_config(None, a.config_text)).num_parameters()
    return {"bamboo": "python -m commands.train.cli " + " ".join(bamboo_args(a, "CONFIG.json")),
            "bare": "transformers' AutoModelForCausalLM (sdpa, no cache), the same weights, a plain loop",
            "model": a.model_config or a.model, "config": json.loads(a.config_text), "parameters": params,
            "device": a.device,
            "precision": f"{a.precision} autocast over {cfg.model.dtype} weights", "seq": a.seq, "batch": a.batch,
            "microbatches": a.microbatches, "tokens_per_iteration": a.microbatches * a.batch * a.seq,
            "iterations": a.iterations, "warm": a.warm, "rounds": a.rounds, "seed": a.seed,
            "optimizer": f"AdamW fused, lr {r.lr} warm-up {r.warmup} then {r.lr_schedule} to {r.min_lr}, "
                         f"betas {r.betas[0]}/{r.betas[1]}, weight decay {r.weight_decay} on matrices",
            "peak_memory": "torch.cuda.max_memory_allocated" if a.device == "cuda" else "peak RSS (wait4)",
            "torch_threads": 1, "torch": torch.__version__, "transformers": transformers.__version__,
            "cores": os.cpu_count(), "load_average_before": round(os.getloadavg()[0], 2)}


def summarise(runs: dict, a, params: dict) -> dict:
    rates = {s: [tokens_per_s(r, a) for r in runs[s]] for s in SIDES}
    worst, match = compare_losses(runs, a)
    ratio, low, high = interval([b / r for b, r in zip(rates["bamboo"], rates["bare"])])
    memory = {s: statistics.median(r["peak_memory_mb"] for r in runs[s]) for s in SIDES}
    result = {s: {"tokens_per_s": round(statistics.median(rates[s]), 1), "peak_memory_mb": round(memory[s], 1),
                  "tokens_per_s_per_round": [round(x, 1) for x in rates[s]],
                  "peak_memory_mb_per_round": [round(r["peak_memory_mb"], 1) for r in runs[s]],
                  "losses": runs[s][0]["losses"][:a.check]} for s in SIDES}
    params["load_average_after"] = round(os.getloadavg()[0], 2)
    print(f"  load average after the rounds: {params['load_average_after']}")
    return {**result, "ratio": round(ratio, 4), "ratio_interval": [round(low, 4), round(high, 4)],
            "memory_ratio": round(memory["bamboo"] / memory["bare"], 4), "loss_max_rel_diff": worst,
            "losses_match": match, "parameters": params}


def print_parameters(params: dict) -> None:
    print("\n".join(f"  {k:22} {v}" for k, v in params.items()), flush=True)


def print_table(result: dict) -> None:
    what = "peak CUDA memory allocated" if result["parameters"]["device"] == "cuda" else "peak RSS"
    print(f"\n  {'side':8} {'tokens_per_s':>13} {'peak_memory_mb':>15}   (medians over rounds)   tokens/s per round")
    for s in SIDES:
        r = result[s]
        print(f"  {s:8} {r['tokens_per_s']:13.1f} {r['peak_memory_mb']:15.1f}                           "
              + " ".join(f"{x:.1f}" for x in r["tokens_per_s_per_round"]))
    low, high = result["ratio_interval"]
    print(f"\n  ratio bamboo/bare tokens/s {result['ratio']:.3f} [{low:.3f}, {high:.3f}] (geometric mean of "
          f"{result['parameters']['rounds']} paired rounds, 95% interval); {what} bamboo/bare "
          f"{result['memory_ratio']:.3f}")


def main(argv=None) -> int:
    a = parse(argv)
    if a.role:
        bare_loop(a)
        return 0
    params = parameters(a)
    print_parameters(params)
    runs: dict[str, list] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory() as d:
        config_file, job_file = f"{d}/config.json", f"{d}/job.json"
        with open(config_file, "w") as f:
            f.write(a.config_text)
        with open(job_file, "w") as f:
            json.dump(a.cfg.to_dict(), f)
        for r in range(a.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:  # neither side always first
                runs[side].append(run_bamboo(a, config_file) if side == "bamboo" else run_bare(a, job_file))
    result = summarise(runs, a, params)
    print_table(result)
    if a.json:
        write_json(a.json, result)
    return 0 if result["losses_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
