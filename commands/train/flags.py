"""bamboo-train's flags, in the groups its --help shows and a --config job file's
sections name (one table, GROUPS, makes both). Checking what they say together is
cli.config_from_args's; here each flag is only declared: name, type, default, help."""
from __future__ import annotations

import argparse
import functools

from schedules.early_grads import SPLITS
from schedules.options import JobRedundancy, JobReplicaSync
from schedules.redundancy import FRC_MODES

from commands.train import jobfile, plan_report
from bamboo.control.config import DTYPES, Surplus, ZoneSpread
from bamboo.data.corpus import TOKEN_DTYPES
from bamboo.control.parser import OneLineParser  # bamboo-launch parses these options too
from bamboo.model.builtin import MODELS
from bamboo.model.sizes import NAMED
from bamboo.control.config import LrSchedule, Precision
from bamboo.transport import devices


def _model_flags(g) -> None:
    g.add_argument("--model", default="tiny",
                   help=f"built-in ({', '.join(sorted(MODELS))}); a Hugging Face shape with random weights "
                        f"({', '.join('hf:' + n for n in NAMED)}; --seq sets its sequence); or a factory "
                        f"package.module:function")
    g.add_argument("--model-config", metavar="FILE.json",
                   help="a Hugging Face GPT-2 or Llama config.json (read offline; random weights from --seed)")
    g.add_argument("--seq", type=int, default=32, help="tokens per sequence for factory and Hugging Face models")
    g.add_argument("--seed", type=int, default=0,
                   help="every layer's first values and the samples each iteration draws come from it alone")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="of the weights and optimizer state (float64 for exact tests)")


def _schedule_flags(g) -> None:
    g.add_argument("--stages", type=int, default=2, help="pipeline depth P")
    g.add_argument("--pipelines", type=int, default=1, help="data-parallel pipelines D")
    g.add_argument("--microbatches", type=int, default=4, help="global microbatches per iteration M")
    g.add_argument("--iterations", type=int, default=10, help="optimizer steps to train")
    g.add_argument("--batch", type=int, default=2, help="sequences per microbatch")
    g.add_argument("--redundancy", choices=JobRedundancy.values(), default="eager",
                   help="eager: the next stage's forward in the bubbles (FRC); lazy: its layers kept in sync, "
                        "FRC and BRC only after a failure; off: no replica; auto (with --local-nodes): the agents "
                        "switch between them from the preemption rate they observe")
    g.add_argument("--frc", choices=FRC_MODES, default="bubbles",
                   help="eager: run the next stage's forward only where the schedule's cost model says it fits the "
                        "node's idle time, and recompute the rest after a failure (bubbles); or for every "
                        "microbatch, at the cost of a longer iteration (all)")
    g.add_argument("--sync-bucket-mb", type=float, default=4.0, metavar="MB",
                   help="lazy and eager with one pipeline and no clipping, ties or fp16: a replica's sync is posted "
                        "in buckets of this many MB as its stage's last backward fills them")
    g.add_argument("--replica-sync", choices=JobReplicaSync.values(), default="auto",
                   help="a replica takes its owner's gradients at the iteration's end, or in the next iteration, off "
                        "the critical path, with limits for now (next: docs/redundancy.md); or as the agents "
                        "choose epoch by epoch from the measured costs and deaths (auto, the default; without "
                        "agents it stays at the end)")
    g.add_argument("--backward-split", choices=SPLITS, default="last",
                   help="last: a node's last backwards (as many as the schedule's cost model says shorten the "
                        "iteration) send their input gradient first and compute their weight gradients one slot "
                        "later, as zero-bubble pipelines do (same math); off: whole backwards (docs/schedules.md)")
    g.add_argument("--auto-prior-rate", type=float, default=0.05, metavar="R",
                   help="--redundancy auto: preemptions per node-hour to assume before any are seen")
    g.add_argument("--auto-prior-hours", type=float, default=2.0, metavar="H",
                   help="--redundancy auto: how many node-hours of observation that assumption weighs")
    g.add_argument("--max-stages-per-node", type=int, default=2, metavar="N",
                   help="with --local-nodes: nodes left over from full pipelines of P form a shorter pipeline in "
                        "which a node runs up to N consecutive stages (1 or 2; 1: they wait in standby)")


def _recipe_flags(g) -> None:
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr", type=float, default=0.0, help="where a linear or cosine schedule ends")
    g.add_argument("--lr-schedule", choices=LrSchedule.values(), default="constant", help="after the warm-up")
    g.add_argument("--warmup", type=int, default=0, metavar="ITERS", help="iterations of linear warm-up")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on weights of 2 or more dimensions")
    g.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"),
                   help="AdamW's moment decay rates")
    g.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip the whole model's gradient norm (all stages) to NORM; 0: never")
    g.add_argument("--precision", choices=Precision.values(), default="fp32",
                   help="bf16, fp16: autocast forwards over float32 weights; fp16 (CUDA) scales its loss dynamically")
    g.add_argument("--initial-loss-scale", type=float, default=65536.0, metavar="S",
                   help="fp16: the loss scale's first value, a power of two (halved after an overflow)")
    g.add_argument("--loss-scale-window", type=int, default=1000, metavar="N",
                   help="fp16: the loss scale doubles after N steps in a row without an overflow")
    g.add_argument("--min-loss-scale", type=float, default=1.0, metavar="S", help="fp16: the scale's floor")


def _data_flags(g) -> None:
    g.add_argument("--data", nargs="+", default=[], metavar="FILE",
                   help="token shards SHARD.tok from bamboo-data, or a directory (or s3://BUCKET/PREFIX/) of them; "
                        "or one raw token file FILE.bin (a flat array of --token-dtype ids, as nanoGPT's prepare.py "
                        "writes); or text files, trained on as bytes (default: the Python standard library's "
                        "sources); s3://BUCKET/KEY and gs://BUCKET/KEY are downloaded once per machine "
                        "($BAMBOO_DATA_CACHE)")
    g.add_argument("--token-dtype", choices=sorted(TOKEN_DTYPES), default="uint16",
                   help="of a raw token file's ids (a shard's header names its own)")
    g.add_argument("--val-fraction", type=float, metavar="F",
                   help="the tail of the token stream held out for validation, never trained on (default 0.05)")
    g.add_argument("--val-data", nargs="+", default=[], metavar="FILE",
                   help="validate on these files instead (shards, nanoGPT's val.bin, or text); the training data "
                        "are not split")
    g.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="validation loss on the pipeline after every K-th iteration and the last; 0: never")
    g.add_argument("--eval-batches", type=int, default=8, metavar="N",
                   help="validation microbatches per evaluation (fixed, split over the pipelines)")


def _checkpoint_flags(g) -> None:
    """Everything the run writes: checkpoints, the final model, its metrics."""
    g.add_argument("--checkpoint", metavar="DIR|s3://BUCKET/PREFIX|gs://BUCKET/PREFIX", help="where checkpoints go")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K iterations")
    g.add_argument("--checkpoint-seconds", type=float, default=0, metavar="T",
                   help="checkpoint once T seconds passed since the last one")
    g.add_argument("--checkpoint-keep", type=int, default=0, metavar="N",
                   help="remove this run's committed checkpoints but the newest N (default 0: keep every one)")
    g.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    g.add_argument("--no-memory-copies", action="store_true",
                   help="keep checkpoints in storage only (by default each is kept in its writer's memory and "
                        "one other node's too, and a rollback takes it from there)")
    g.add_argument("--save-dir", metavar="DIR", help="write the final parameters, one file per layer")
    g.add_argument("--export", metavar="DIR", help="write the trained model to DIR as one safetensors checkpoint; "
                                                   "for hf: models, a directory from_pretrained loads")
    g.add_argument("--metrics-out", metavar="FILE", help="JSON lines, one per iteration, then a summary")
    g.add_argument("--plot", metavar="PNG", help="at the end, draw loss, samples/s and live nodes against "
                                                 "wall-clock time, with the run's events marked (bamboo-plot)")
    g.add_argument("--tensorboard", metavar="DIR", help="write loss, samples/s, nodes and events there as "
                                                        "iterations finish (tensorboard --logdir DIR)")
    g.add_argument("--no-progress", action="store_true", help="draw no progress bar")


def _fault_flags(g) -> None:
    g.add_argument("--failure-timeout", type=float, default=3.0,
                   help="seconds without a lease refresh after which a node counts as dead")
    g.add_argument("--lease-ttl", type=float, default=15.0,
                   help="etcd lease TTL: how long etcd may be unreachable before nodes must register again")
    g.add_argument("--hang-timeout", type=float, default=300.0,
                   help="a node whose main thread is stuck this long counts as dead; gloo's operation timeout")
    g.add_argument("--straggler-factor", type=float, default=5.0,
                   help="a node that computed more than this many times its peers' median in one iteration "
                        "(and --straggler-slack seconds more) is fenced as a straggler; 0: never")
    g.add_argument("--straggler-slack", type=float, default=3.0,
                   help="seconds a straggler's compute must exceed its peers' median by, too")
    g.add_argument("--stall-timeout", type=float, default=1800.0,
                   help="give up when no iteration finishes for this many seconds")


def _cluster_flags(g) -> None:
    g.add_argument("--etcd", metavar="HOST:PORT[,HOST:PORT...]",
                   help="use this etcd instead of starting one (several: the members of one etcd cluster)")
    g.add_argument("--etcd-tls", metavar="DIR",
                   help="with --etcd: ca.pem, client.pem and client-key.pem for it (default: $BAMBOO_ETCD_TLS); "
                        "without them that etcd is used in the clear. The embedded etcd always has its own")
    g.add_argument("--etcd-members", type=int, default=1, metavar="N",
                   help="without --etcd: start an etcd cluster of N members (1, 3, 5 or 7), named after --zones; "
                        "a job then survives losing a minority of them")
    g.add_argument("--job", help="name the job (default: a fresh unique name); with --etcd and --local-nodes, "
                                 "a job of that name that runs already is joined")
    g.add_argument("--local-nodes", type=int, metavar="N",
                   help="run N nodes, each an elastic agent, that keep reconfiguring (D = nodes // P)")
    g.add_argument("--local-hosts", type=int, metavar="H",
                   help="instead of --local-nodes: H local machines of --workers-per-host nodes each, a machine's "
                        "loss taking all of them (one bamboo-agent --workers N per machine)")
    g.add_argument("--workers-per-host", type=int, metavar="N", help="with --local-hosts: nodes per machine "
                                                                     "(default 2)")
    g.add_argument("--zones", default="a", metavar="A,B,...",
                   help="zones of the local nodes (with --local-hosts, of the machines), dealt in turn")
    g.add_argument("--notice", choices=("ec2", "gcp"), help="with --local-nodes: agents watch this cloud's "
                                                           "preemption notices")
    g.add_argument("--metadata-url", metavar="URL", help="the metadata service the agents watch ({node} is "
                                                         "replaced by the node id)")
    g.add_argument("--last-call", type=float, default=10.0, metavar="SECONDS",
                   help="with --local-nodes: when not every node came, the first configuration starts this long "
                        "after one pipeline's nodes met, with those alive (docs/faults.md)")
    g.add_argument("--surplus", choices=Surplus.values(), default=Surplus.BURST.value,
                   help="the nodes in no pipeline are released but for the standby the burst rule sizes from the "
                        "deaths seen and auto's prior (burst; binomial: ByteRobust's quantile; fixed: "
                        "--fixed-standby), nodes asked for again coming --acquire-seconds later; or every node is "
                        "kept (keep) (docs/faults.md)")
    g.add_argument("--fixed-standby", type=int, default=2, metavar="N",
                   help="with --surplus fixed: the standby kept")
    g.add_argument("--acquire-seconds", type=float, default=300.0, metavar="S",
                   help="with --surplus: how long a node the job asks for takes to come (the burst rule's window)")
    g.add_argument("--standby-epsilon", type=float, default=0.01, metavar="E",
                   help="with --surplus burst: the standby covers the losses within --acquire-seconds but with "
                        "this chance")
    g.add_argument("--zone-spread", choices=ZoneSpread.values(), default=ZoneSpread.SPREAD.value,
                   help="with --zones: neighbouring stages in different zones, so a zone's burst never takes a "
                        "node with its replica's holder (spread); or each pipeline in as few zones as it can, the "
                        "pipelines in different zones, so that only the data-parallel reduce crosses a zone, "
                        "which clouds bill (pack; bamboo-sim --zone-spread auto prices the two)")
    g.add_argument("--join", action="append", default=[], metavar="COUNT@ITER",
                   help="with --local-nodes: COUNT more nodes join after iteration ITER (repeatable)")
    g.add_argument("--log-dir", metavar="DIR", help="keep every agent's and worker's log in DIR (default: a temp "
                                                     "dir, removed after a clean run)")


def _testing_flags(g) -> None:
    g.add_argument("--preempt", action="append", default=[], metavar="NODE@ITER[:INSTR]",
                   help="SIGKILL that worker just before that instruction (repeatable; INSTR evalK: before "
                        "instruction K of its evaluation stream after the step), or 'random'")
    g.add_argument("--check-replicas", action="store_true",
                   help="compare digests of every copy of every stage after each step")
    g.add_argument("--compute-ahead", action="store_true",
                   help="on CPU workers, stage 0's owner runs the next iteration's first forwards on a thread once "
                        "its own stream has ended, sent once the iteration boundary agrees; the streams get an order "
                        "that leaves room for them (more forwards first, weight passes held back: more memory). "
                        "On the hot path's benchmark 4 percent faster on its small shape, nothing on its large one "
                        "(docs/HOTPATH.md)")
    g.add_argument("--local-prefix", default="", metavar="CMD",
                   help="with --local-nodes: run each agent under this command, {node} replaced by its id "
                        "(the network namespaces of bamboo-chaos --network)")


# (a job file's section, the --help group's title, its flags): one table, so the two cannot drift
GROUPS = (("model", "model", _model_flags),
          ("schedule", "schedule and redundancy", _schedule_flags),
          ("recipe", "recipe", _recipe_flags),
          ("data", "data", _data_flags),
          ("checkpoints", "checkpoints and outputs", _checkpoint_flags),
          ("faults", "faults and liveness", _fault_flags),
          ("devices", "devices", devices.add_flags),
          ("cluster", "cluster", _cluster_flags),
          ("testing", "testing and diagnostics", _testing_flags))
# Job files written before a group existed keep working: its keys are still read
# in the sections they were first declared in (section -> key -> former section).
FORMERLY = {"testing": {"preempt": "faults", "check_replicas": "faults", "compute_ahead": "schedule",
                        "local_prefix": "cluster"}}


def build_parser() -> argparse.ArgumentParser:
    """bamboo-train's flags, grouped as --help shows them and a --config file's
    sections name them."""
    p = OneLineParser(prog="bamboo-train", description="`bamboo-train`: train a model with pipeline parallelism that "
                                                  "survives preemptions.")
    p.add_argument("--config", metavar="FILE.toml",
                   help="read the flags from this TOML job file first, a section per group below and a key per "
                        "flag (docs/job-file.md); flags given here override it")
    for section, title, add in GROUPS:
        add(jobfile.add_section(p, section, title, FORMERLY.get(section)))
    plan_report.add_flags(p)
    return p


def flag_named(token: str) -> str:
    """The flag a command-line token names, as argparse reads it: `--x=1` names
    `--x`, and a unique prefix (`--metrics-o`) the flag it abbreviates; any other
    token is returned as it is."""
    flag = token.split("=", 1)[0]
    known = _option_names()
    if not flag.startswith("--") or flag in known:
        return flag
    matches = [k for k in known if k.startswith(flag)]
    return matches[0] if len(matches) == 1 else flag


@functools.lru_cache(maxsize=1)
def _option_names() -> tuple[str, ...]:
    return tuple(s for a in build_parser()._actions for s in a.option_strings)
