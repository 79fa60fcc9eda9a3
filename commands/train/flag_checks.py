"""bamboo-train's flags checked on their face, and the ones a run leaves unused.

A value no run could use (NaN or infinity, a negative seed, an empty zone or job
name, a file where a directory goes, a --preempt that is not a spec) is refused
whatever the rest of the command line says: `check_on_face`, the first check of
cli.config_from_args (its `check_finite` serves bamboo-sim and bamboo-replay too).
A flag set away from its default that this run does not use gets one note line
(`idle_notes`, printed by bamboo-train), so that nobody believes it took effect.
The checkpoint and liveness flags' own rules are here too."""
from __future__ import annotations

import math
import os

from schedules.layout import MICROBATCHES_MAX
from schedules.options import JobRedundancy, JobReplicaSync, Redundancy, ReplicaSync

from bamboo.control.config import LrSchedule, Precision
from bamboo.control.protocol import check_job_name
from bamboo.data.objects import is_remote

SEED_MAX = 2**48  # layer i's weights come from torch.manual_seed(seed * 7919 + i): it must stay in 64 bits

# Flags a --stages 1 run (one process, the single-process reference) does not read.
SINGLE_IGNORES = ("redundancy", "frc", "replica_sync", "backward_split", "sync_bucket_mb", "compute_ahead", "auto_prior_rate",
                  "auto_prior_hours", "max_stages_per_node", "preempt", "failure_timeout", "lease_ttl", "hang_timeout",
                  "straggler_factor", "straggler_slack", "stall_timeout", "check_replicas", "no_memory_copies",
                  "etcd", "etcd_tls", "etcd_members", "job", "local_nodes", "local_hosts", "workers_per_host",
                  "zones", "notice", "metadata_url", "last_call", "log_dir", "transport", "share_gpu", "surplus",
                  "acquire_seconds", "standby_epsilon", "fixed_standby", "zone_spread")
AGENT_ONLY = ("zones", "notice", "metadata_url", "last_call", "max_stages_per_node", "surplus", "acquire_seconds",
              "standby_epsilon", "fixed_standby", "zone_spread")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_not_a_file(path: str | None, flag: str) -> None:
    """Raise ValueError if `path`, where a directory goes, is a file already."""
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a directory")


def check_finite(parser, args) -> None:
    """Raise ValueError naming the first float flag of `parser` given NaN or infinity,
    which the range checks after it (`x <= 0`: False for NaN) would let through."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.type is float and value is not None:
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if not math.isfinite(v):
                    raise ValueError(f"{action.option_strings[0]} must be a finite number (got {v})")

LOCAL_NODES_MAX = 256  # agents and workers of one machine's local job (twice as many processes)


def check_on_face(args) -> None:
    """Raise ValueError naming the first flag whose value no run could use."""
    for name in ("stages", "pipelines", "microbatches", "iterations", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.microbatches > MICROBATCHES_MAX:
        raise ValueError(f"--microbatches must be at most {MICROBATCHES_MAX} (got {args.microbatches})")
    if args.local_nodes is not None and not 1 <= args.local_nodes <= LOCAL_NODES_MAX:
        raise ValueError(f"--local-nodes must be from 1 to {LOCAL_NODES_MAX}, processes on this machine "
                         f"(got {args.local_nodes})")
    from commands.train.flags import build_parser  # torch: not for check_finite's other callers (bamboo-sim)
    check_finite(build_parser(), args)
    if not 0 <= args.seed <= SEED_MAX:
        raise ValueError(f"--seed must be a whole number from 0 to {SEED_MAX} (got {args.seed})")
    if args.seq < 1:
        raise ValueError(f"--seq must be at least 1 token (got {args.seq})")
    if args.stall_timeout <= 0:
        raise ValueError(f"--stall-timeout must be a positive number of seconds (got {args.stall_timeout})")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ValueError(f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale "
                         f"{args.initial_loss_scale}: the scale's floor must not exceed where it starts")
    if args.job is not None and not args.job.strip():
        raise ValueError("--job must not be empty")
    if args.job is not None:
        check_job_name(args.job)
    if not all(z.strip() for z in args.zones.split(",")):
        raise ValueError(f"--zones {args.zones!r}: expected names separated by commas")
    local_checkpoint = args.checkpoint if args.checkpoint and "://" not in args.checkpoint else None
    for flag, path in (("--save-dir", args.save_dir), ("--log-dir", args.log_dir), ("--checkpoint", local_checkpoint)):
        check_not_a_file(path, flag)
    if args.compute_ahead and args.devices and args.devices.strip() != "cpu":
        raise ValueError("--compute-ahead runs its thread on CPU workers only, and --devices names GPUs: there it "
                         "would only reorder the streams, holding more activations for nothing")
    from commands.train.preempts import parse_spec
    for spec in args.preempt:
        if spec != "random":
            parse_spec(spec)


def idle_notes(args) -> list[str]:
    """One line per reason, naming the flags set away from their defaults that this
    run does not use."""
    from commands.train.flags import build_parser
    from bamboo.data.corpus import is_token_file
    from bamboo.data.shards import is_shard
    from bamboo.model.builtin import MODELS
    changed = changed_flags(build_parser(), args)
    builtin = args.model in MODELS and not args.model_config
    raw_token_files = any(is_token_file(f) and not is_shard(f) for f in (*args.data, *args.val_data))
    rules = (
        (args.stages == 1, SINGLE_IGNORES, "--stages 1 runs one process: no pipeline, redundancy, agents or etcd"),
        (args.local_nodes is None, AGENT_ONLY, "they are for the agents of --local-nodes or --local-hosts"),
        (args.redundancy != JobRedundancy.AUTO and args.replica_sync != JobReplicaSync.AUTO,
         ("auto_prior_rate", "auto_prior_hours"), "they are for --redundancy auto and --replica-sync auto"),
        (args.redundancy == Redundancy.OFF, ("replica_sync",), "--redundancy off keeps no replica to sync"),
        (args.precision != Precision.FP16, ("initial_loss_scale", "loss_scale_window", "min_loss_scale"),
         "the loss scale is --precision fp16's"),
        (args.lr_schedule == LrSchedule.CONSTANT, ("min_lr",), "a constant --lr-schedule never leaves --lr"),
        (not args.eval_every, ("eval_batches",), "--eval-every 0 never evaluates"),
        (not args.straggler_factor, ("straggler_slack",), "--straggler-factor 0 fences no straggler"),
        (builtin, ("seq",), f"the built-in model {args.model} has its own sequence length"),
        (not raw_token_files, ("token_dtype",), "the data are text or token shards, not a raw token file (.bin): "
                                                "a shard's header names its dtype"),
        (args.redundancy == Redundancy.OFF or args.pipelines > 1 or bool(args.grad_clip)
         or args.precision == Precision.FP16 or args.replica_sync == ReplicaSync.NEXT, ("sync_bucket_mb",),
         "the replica sync is posted whole with --redundancy off, --pipelines above 1, --grad-clip, fp16 or "
         "--replica-sync next"),
    )
    return said_idle(changed, rules)


def changed_flags(parser, args) -> set[str]:
    """The dests of `parser`'s flags that `args` sets away from their defaults."""
    return {a.dest for a in parser._actions if a.dest != "help" and getattr(args, a.dest, a.default) != a.default}


def said_idle(changed: set[str], rules) -> list[str]:
    """For each (applies, dests, why) rule that applies, one line naming the `changed`
    dests it makes idle (each named once, by its first rule)."""
    notes, said = [], set()
    for applies, dests, why in rules:
        idle = [d for d in dests if d in changed and d not in said] if applies else []
        if idle:
            said |= set(idle)
            verb = "does" if len(idle) == 1 else "do"
            notes.append(f"{', '.join(map(_flag, idle))} {verb} nothing in this run: {why}")
    return notes


def check_checkpoint(location: str | None) -> None:
    """An object-storage checkpoint's bucket answers a listing now, not at the
    first checkpoint (or resume) of the run."""
    if location and is_remote(location):
        from bamboo.data.objects import bucket_of
        bucket, prefix = bucket_of(location)
        bucket.list(prefix.strip("/") + "/" if prefix.strip("/") else "")


def check_checkpoint_flags(args) -> None:
    """How often and how many: not negative, and only with a place to write them."""
    if (args.checkpoint_every or args.checkpoint_seconds or args.checkpoint_keep or args.resume) \
            and not args.checkpoint:
        raise ValueError("--checkpoint-every, --checkpoint-seconds, --checkpoint-keep and --resume need --checkpoint "
                         "DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX")
    if args.checkpoint_every < 0 or args.checkpoint_seconds < 0 or args.checkpoint_keep < 0:
        raise ValueError("--checkpoint-every, --checkpoint-seconds and --checkpoint-keep must not be negative")


def check_liveness(args) -> None:
    """The timeouts that decide when a node counts as dead or a straggler."""
    for flag in ("failure_timeout", "lease_ttl", "hang_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)})")
    if args.straggler_factor < 0 or (args.straggler_factor and args.straggler_factor <= 1) or args.straggler_slack < 0:
        raise ValueError("--straggler-factor must be 0 (off) or above 1, and --straggler-slack not negative "
                         f"(got {args.straggler_factor} and {args.straggler_slack})")
    if not math.isfinite(args.acquire_seconds) or args.acquire_seconds < 0:
        raise ValueError(f"--acquire-seconds must be a finite number of seconds, not negative (got "
                         f"{args.acquire_seconds})")
    if not 0 < args.standby_epsilon < 1:
        raise ValueError(f"--standby-epsilon must be above 0 and below 1 (got {args.standby_epsilon})")
    if args.fixed_standby < 0:
        raise ValueError(f"--fixed-standby must not be negative (got {args.fixed_standby})")
    if not math.isfinite(args.last_call) or args.last_call < 0:
        raise ValueError(f"--last-call must be a finite number of seconds, not negative (got {args.last_call})")
    if args.lease_ttl <= args.failure_timeout:
        raise ValueError(f"--lease-ttl {args.lease_ttl} must exceed --failure-timeout {args.failure_timeout}")
