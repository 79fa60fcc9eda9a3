"""`--plan` as a command: the target it must fit, the table it prints, the one
line that refuses a layout, and `--propose`'s search for layouts that fit."""
from __future__ import annotations

import os

import torch

from bamboo.control.config import JobConfig
from bamboo.model.activations import layer_bytes
from bamboo.model.api import ModelSource
from commands.train.instances import GIB, INSTANCES, instance
from commands.train.plan import CONTEXT_GIB, Plan, Target, least_gpu_bytes, make_plan

PROPOSALS = 3        # layouts --propose prints
MAX_BATCH = 16       # the largest microbatch (sequences) it tries


def add_flags(p) -> None:
    """bamboo-train's planning flags: what a run is checked against, not part of a job file."""
    g = p.add_argument_group("plan (print, check and exit: nothing is started)")
    g.add_argument("--plan", action="store_true",
                   help="print each worker's GPU and host memory, the bubble, tokens and network bytes per "
                        "iteration, and refuse a layout that does not fit (exit status 2)")
    g.add_argument("--propose", action="store_true",
                   help="with --plan: also the layouts of the same nodes and tokens per iteration that fit, "
                        "fastest first")
    g.add_argument("--instance-type", metavar="TYPE", choices=sorted(INSTANCES),
                   help=f"with --plan: fit this instance type's GPU and host memory (known: {', '.join(INSTANCES)})")
    g.add_argument("--gpu-memory", type=float, metavar="GIB", help="with --plan: each GPU's memory (default: this "
                   "machine's first GPU, if it has one)")
    g.add_argument("--host-memory", type=float, metavar="GIB",
                   help="with --plan: each host's memory, shared by its workers (default: this machine's)")


def check_flags(args) -> None:
    given = [f for f, v in (("--propose", args.propose), ("--instance-type", args.instance_type),
                            ("--gpu-memory", args.gpu_memory), ("--host-memory", args.host_memory)) if v]
    if given and not args.plan:
        raise ValueError(f"{given[0]} goes with --plan")
    for flag, value in (("--gpu-memory", args.gpu_memory), ("--host-memory", args.host_memory)):
        if value is not None and not 0 < value < 1e6:
            raise ValueError(f"{flag} must be a positive number of GiB (got {value})")
    if args.instance_type and (args.gpu_memory or args.host_memory):
        raise ValueError("--instance-type sets the GPU and host memory: leave out --gpu-memory and --host-memory")


def target_of(args, workers_per_host: int = 1) -> Target:
    """What the plan must fit: an instance type, the sizes given, or this machine."""
    if args.instance_type:
        kind = instance(args.instance_type)
        return Target(f"{kind.name} ({kind.gpu})", kind.gpu_bytes, kind.host_bytes, kind.gpus)
    gpu = args.gpu_memory * GIB if args.gpu_memory else None
    name = f"{args.gpu_memory:g} GiB GPUs" if gpu else "this machine"
    if gpu is None and torch.cuda.is_available():
        gpu, name = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    host = args.host_memory * GIB if args.host_memory else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Target(name, int(gpu) if gpu else None, int(host), workers_per_host)


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def describe(plan: Plan, cfg: JobConfig, nodes: int, target: Target) -> list[str]:
    """The plan as the lines --plan prints."""
    sch, stages = cfg.schedule, plan.stages
    seq = plan.tokens // max(1, sch.microbatches * sch.batch)
    lines = [f"plan: {cfg.model.name}, {plan.params / 1e6:,.1f}M parameters, {nodes} node(s): P={sch.stages}, "
             f"M={sch.microbatches} ({plan.per_pipeline} per pipeline), batch {sch.batch} x seq {seq}"
             f" = {plan.tokens:,} tokens per iteration; {cfg.model.dtype} weights, {cfg.recipe.precision.value}, "
             f"--redundancy {sch.redundancy.value}{', agents' if cfg.cluster.elastic else ''}",
             "per GPU (GiB)".ljust(28) + "".join(f"{'stage ' + str(m.stage):>9}" for m in stages)]
    for row in stages[0].device:
        lines.append(f"  {row:26}" + "".join(_gib(m.device[row]) + " " for m in stages))
    lines.append("  peak in the compute phase".ljust(28) + "".join(_gib(m.compute_peak) + " " for m in stages))
    lines.append("  peak in the iteration tail".ljust(28) + "".join(_gib(m.tail_peak) + " " for m in stages))
    lines.append("  peak".ljust(28) + "".join(_gib(m.gpu_total) + " " for m in stages))
    lines.append("per worker, host (GiB)")
    for row in stages[0].host:
        lines.append(f"  {row:26}" + "".join(_gib(m.host[row]) + " " for m in stages))
    lines.append(f"bubble: {plan.bubble:.1%} of a fault-free iteration idle ({sch.backward_split.value} backward "
                 f"split, each stage's time in proportion to its parameters)")
    lines.append("network per iteration: " + "; ".join(f"{k} {v / GIB:.3f} GiB" for k, v in plan.links.items()))
    lines += [f"note: {n}" for n in plan.notes]
    why = plan.misfit(target)
    if target.gpu_bytes is None:
        lines.append("no GPU to fit: give --instance-type or --gpu-memory")
    elif why is None:
        spare = target.gpu_bytes - CONTEXT_GIB * GIB - plan.worst().gpu_total
        lines.append(f"fits {target.name}: {spare / GIB:.1f} GiB of GPU memory to spare on the fullest worker "
                     f"(after {CONTEXT_GIB} GiB for the CUDA context)")
    return lines


def propose(cfg: JobConfig, source: ModelSource, sizes: tuple, nodes: int, target: Target) -> list[str]:
    """Layouts of the same nodes and tokens per iteration that fit `target`, fastest
    (by the cost model's iteration time per token) first, as bamboo-train flags;
    `sizes` = (per-layer parameters, per-layer activations), as run_plan measured them."""
    sequences = cfg.schedule.microbatches * cfg.schedule.batch
    (costs, measured), shape, found = sizes, (nodes, source.seq), []
    for stages in range(2, min(nodes, source.count) + 1):
        for batch in range(1, min(sequences, MAX_BATCH) + 1):
            microbatches = sequences // batch
            if sequences % batch or microbatches < nodes // stages:
                continue
            trial = cfg.with_(stages=stages, batch=batch, microbatches=microbatches)
            if target.gpu_bytes is not None and least_gpu_bytes(trial, costs, measured, shape) > target.gpu_bytes:
                continue  # its weights and states alone do not fit: no stream to compile
            plan = make_plan(trial, costs, measured, shape)
            if plan.misfit(target) is None:
                found.append((plan.time_per_token, stages, batch, microbatches, plan))
    found.sort(key=lambda f: f[:3])
    if not found:
        return [f"no layout of {nodes} node(s) and {sequences} sequences per iteration fits {target.name}"]
    return [f"fits: --stages {p} --microbatches {m} --batch {b}: peak {plan.worst().gpu_total / GIB:.1f} GiB per GPU, "
            f"bubble {plan.bubble:.1%}, {t / found[0][0]:.2f}x the fastest's time" for t, p, b, m, plan in
            found[:PROPOSALS]]


def measure(cfg: JobConfig) -> tuple[ModelSource, list[float], list]:
    """The job's model, its parameters per layer (every layer built on the meta
    device) and its activations per layer (measured): what a plan is made of."""
    source = ModelSource.of(cfg.model)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.recipe.precision.value)
    return source, source.costs(), layer_bytes(source, autocast)


def run_plan(args, cfg: JobConfig, nodes: int, target: Target) -> int:
    """--plan: print the plan against `target` (and --propose's layouts); ValueError when it does not fit."""
    source, costs, measured = measure(cfg)  # once, for the plan and the proposals
    plan = make_plan(cfg, costs, measured, (nodes, source.seq))
    print("\n".join(describe(plan, cfg, nodes, target)))
    if args.propose:
        print("\n".join(propose(cfg, source, (costs, measured), nodes, target)))
    why = plan.misfit(target)
    if why is not None:
        raise ValueError(f"--plan: {why}" + ("" if args.propose else "; --propose finds layouts that fit"))
    return 0


