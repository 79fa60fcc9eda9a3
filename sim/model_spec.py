"""bamboo-sim's model and bill: one of its own profiles (sim/profiles.py) or the
model a user trains (bamboo-train's `--model` and `--model-config`: a built-in, an
`hf:` shape, a config.json), on an instance type of the shipped table, with what a
cloud bills besides the nodes (sim/pricing.py)."""
from __future__ import annotations

import argparse
import os

from schedules.layout import MICROBATCHES_MAX

from bamboo.control.config import JobConfig, Precision
from bamboo.model.api import ModelError
from commands.train.instances import INSTANCES, InstanceError, gpu_flops, instance, with_prices
from sim.pricing import GIB, Charges
from sim.profiles import GPU_PEAK_FLOPS, PROFILES, Profile, profile

MAX_CONFIG_BYTES = 1 << 20


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a user's model, its instances and its bill")
    g.add_argument("--model-config", metavar="FILE.json",
                   help="a Hugging Face GPT-2 or Llama config.json, as bamboo-train takes it")
    g.add_argument("--seq", type=int, help="for a bamboo-train model: tokens per sequence (default: its positions, "
                                           "at most 2048)")
    g.add_argument("--batch", type=int, default=1, help="for a bamboo-train model: sequences per microbatch")
    g.add_argument("--precision", choices=[p.value for p in Precision], default="bf16",
                   help="for a bamboo-train model: the GPU rate (16-bit tensor cores or fp32) and the bytes sent")
    g.add_argument("--instance-type", metavar="TYPE", choices=sorted(INSTANCES),
                   help="the nodes' type: its spot and on-demand prices replace --spot-price and --on-demand-price, "
                        "its GPU sets a bamboo-train model's speed")
    g.add_argument("--prices", metavar="FILE.json", help='prices replacing the table\'s, {"g5.xlarge": {"spot": 0.4}}')
    g.add_argument("--cross-zone-price", type=float, default=0.0, metavar="USD_PER_GIB",
                   help="bytes sent between zones (EC2 0.02: 0.01 out, 0.01 in; GCP 0.01)")
    g.add_argument("--etcd-price", type=float, default=0.0, metavar="USD_PER_HOUR", help="the job's etcd instances")
    g.add_argument("--storage-price", type=float, default=0.0, metavar="USD_PER_GIB_MONTH",
                   help="checkpoint storage (S3 0.023, GCS 0.020), for one checkpoint kept")
    g.add_argument("--boot-seconds", type=float, default=0.0, metavar="S",
                   help="each node's paid time from its start until it can join (boot, install)")


def is_training_model(args) -> bool:
    """Whether --model names a bamboo-train model rather than one of the simulator's profiles."""
    return args.model_config is not None or args.model not in PROFILES


def instance_of(args):
    """The --instance-type's row, with --prices; None without one."""
    if args.prices and not args.instance_type:
        raise ValueError("--prices goes with --instance-type")
    if not args.instance_type:
        return None
    try:
        return instance(args.instance_type, with_prices(args.prices) if args.prices else INSTANCES)
    except InstanceError as e:
        raise ValueError(str(e)) from None


def _config_text(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ValueError(f"--model-config {path}: larger than {MAX_CONFIG_BYTES} bytes")
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--model-config {path}: cannot read it ({e.strerror})") from None


def training_model(args, nodes: int):
    """A bamboo-train model as sim/job_model.py profiles it, on `nodes` nodes."""
    from bamboo.model.api import ModelSource
    from sim.job_model import job_model
    text = _config_text(args.model_config)
    name = "hf:config" if text else args.model
    try:
        seq = args.seq
        if seq is None:
            source = ModelSource(name, 0, config_json=text)
            seq = min(2048, source.hf.max_seq) if source.hf is not None else source.seq
        cfg = JobConfig.of(name=name, config_json=text, seq=seq, stages=args.stages, batch=args.batch,
                           microbatches=args.microbatches or 24, precision=Precision(args.precision), elastic=True)
        kind = instance_of(args)
        peak = gpu_flops(kind, Precision(args.precision) is not Precision.FP32) if kind else GPU_PEAK_FLOPS
        return job_model(cfg, nodes, peak)
    except ModelError as e:
        raise ValueError(str(e)) from None


def own_profile(args) -> Profile:
    """One of bamboo-sim's profiles, from --profile's source."""
    for flag, given in (("--seq", args.seq is not None), ("--batch", args.batch != 1)):
        if given:
            raise ValueError(f"{flag} is for a bamboo-train model: profile {args.model} fixes its own")
    return profile(args.model, args.profile)


def charges(args, checkpoint_bytes: float) -> Charges:
    """The bill beyond the nodes, from the flags (each checked, named by its flag)."""
    for flag in ("cross_zone_price", "etcd_price", "storage_price", "boot_seconds"):
        value = getattr(args, flag)
        if not 0 <= value < 1e6:
            raise ValueError(f"--{flag.replace('_', '-')} must be from 0 up (got {value})")
    return Charges(args.cross_zone_price, args.etcd_price, args.storage_price, checkpoint_bytes / GIB,
                   args.boot_seconds)


def check_shape(args) -> None:
    """--stages, --batch, --seq and --microbatches within their bounds, before any model is built."""
    if args.stages < 2:
        raise ValueError(f"--stages must be at least 2 (got {args.stages})")
    if args.batch < 1 or (args.seq is not None and args.seq < 1):
        raise ValueError(f"--batch and --seq must be at least 1 (got {args.batch}, {args.seq})")
    if args.microbatches is not None and args.microbatches < 1:
        raise ValueError(f"--microbatches must be at least 1 (got {args.microbatches})")
    if args.microbatches is not None and args.microbatches > MICROBATCHES_MAX:
        raise ValueError(f"--microbatches must be at most {MICROBATCHES_MAX} (got {args.microbatches})")
