"""`bamboo-train`: train a model with pipeline parallelism that survives preemptions.

With no cluster arguments it starts an embedded etcd and P x D worker processes on
this machine. `--stages 1 --pipelines 1` runs the plain single-process reference on
the same samples. Bad arguments and unsurvivable failures end with one line on
stderr and a non-zero exit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import numpy as np
import torch

from commands.train import jobfile, plan_report
from commands.train.flag_checks import (check_checkpoint, check_checkpoint_flags, check_liveness, check_not_a_file,
                                        check_on_face, idle_notes)
from commands.train.flags import build_parser
from commands.train.plot import check_output
from commands.train.preempts import parse_preempts
from bamboo.control.config import (CheckpointSpec, ClusterSpec, DataSpec, DeviceSpec, FaultSpec, JobConfig,
                                   ModelSpec, Precision, RecipeSpec, ScheduleSpec, TestingSpec, Transport)
from bamboo.control.credentials import ENV as TLS_ENV, ClientFiles
from bamboo.data.corpus import TOKEN_DTYPES, check_files, check_remote_shards, corpora, expand, is_token_file
from bamboo.data.shards import is_shard
from bamboo.data.objects import is_remote
from bamboo.model.api import ModelSource
from bamboo.model.builtin import fp16_allowed
from bamboo.model.recipe import check as check_recipe
from bamboo.transport import devices
from schedules.options import Frc, JobRedundancy, Redundancy, ReplicaSync


def local_cluster(args):
    """The --local-nodes/--zones/--join settings, checked, or None."""
    from commands.train.launcher import LocalCluster
    if args.local_nodes is None:
        if args.join or args.local_prefix:
            raise ValueError(f"{'--join' if args.join else '--local-prefix'} needs --local-nodes")
        return None
    zones = tuple(z.strip() for z in args.zones.split(","))  # each a name: check_on_face
    if args.local_nodes < args.stages:
        raise ValueError(f"--local-nodes {args.local_nodes} is fewer than --stages {args.stages}")
    if args.local_hosts and args.join:
        raise ValueError("--join with --local-hosts: machines join a running job with a second bamboo-train "
                         "--etcd E --job NAME --local-hosts H")
    joins = []
    for spec in args.join:
        count, _, it = spec.partition("@")
        if not (count.isdigit() and it.isdigit() and int(count) > 0):
            raise ValueError(f"--join {spec!r}: expected COUNT@ITERATION")
        if int(it) >= args.iterations - 1:
            raise ValueError(f"--join {spec!r}: nodes join after iteration {it}, and the job's last is "
                             f"{args.iterations - 1} (--iterations {args.iterations})")
        joins.append((int(count), int(it)))
    return LocalCluster(args.local_nodes, zones, tuple(joins), args.notice, args.metadata_url, args.local_hosts or 0,
                        args.workers_per_host or 1, args.local_prefix)


def local_hosts(args) -> None:
    """--local-hosts H --workers-per-host N, checked: H x N local nodes (--local-nodes)."""
    if args.local_hosts is None:
        if args.workers_per_host is not None:
            raise ValueError("--workers-per-host needs --local-hosts")
        return
    if args.local_nodes is not None:
        raise ValueError("--local-hosts with --local-nodes: give one (machines of --workers-per-host nodes, "
                         "or nodes each a machine of its own)")
    per = 2 if args.workers_per_host is None else args.workers_per_host
    if args.local_hosts < 1 or per < 1:
        raise ValueError(f"--local-hosts {args.local_hosts} --workers-per-host {per}: both must be at least 1")
    if args.local_hosts * per < args.stages:
        raise ValueError(f"--local-hosts {args.local_hosts} of --workers-per-host {per} give {args.local_hosts * per} "
                         f"nodes, fewer than --stages {args.stages}")
    args.local_nodes, args.workers_per_host = args.local_hosts * per, per


def check_writable(path: str | None, flag: str) -> None:
    """Fail now, not after training, if `path`'s directory cannot take a file."""
    if path:
        check_output(path, flag)  # its BadInput is a ValueError, as the callers catch


def check_directory(path: str | None, flag: str) -> None:
    """Fail now, not at the first iteration, if `path` cannot be a directory of files."""
    if not path:
        return
    check_not_a_file(path, flag)
    check_writable(os.path.join(path, "probe"), flag)


def check_outputs(args) -> None:
    """The files the run will write, checked before it starts."""
    check_writable(args.metrics_out, "--metrics-out")
    check_writable(args.plot, "--plot")
    if args.plot and args.metrics_out and os.path.abspath(args.plot) == os.path.abspath(args.metrics_out):
        raise ValueError(f"--plot {args.plot!r} is the --metrics-out file")
    check_directory(args.tensorboard, "--tensorboard")
    if args.export:
        from bamboo.model.export import check_target
        check_target(args.export)


def metric_sinks(args) -> tuple:
    """Where iteration records go besides --metrics-out: --tensorboard as they come,
    --plot at the end."""
    sinks = []
    if args.tensorboard:
        from commands.train.board import Board
        sinks.append(Board(args.tensorboard))
    if args.plot:
        from commands.train.plot import PlotSink
        sinks.append(PlotSink(args.plot))
    return tuple(sinks)


def start_pipelines(args) -> int:
    """With agents, the pipelines at the start: as many as the nodes make."""
    return max(1, args.local_nodes // max(1, args.stages))


def check_replica_sync(args) -> None:
    """--replica-sync next runs, for now, without --check-replicas, and with agents
    needs a checkpoint. auto (the default) is the agents' choice,
    which keeps the sync at the end where the next would not do (agents/modes.py
    `syncs_allowed`); without agents nobody chooses and it stays at the end."""
    if args.replica_sync != ReplicaSync.NEXT or args.stages == 1 or args.redundancy == Redundancy.OFF:
        return
    if args.check_replicas:
        raise ValueError("--replica-sync next does not run with --check-replicas yet: use --replica-sync end or auto")
    if args.local_nodes is not None and not args.checkpoint:
        raise ValueError("--replica-sync next with agents needs --checkpoint DIR|s3://BUCKET/PREFIX|gs://BUCKET/"
                         "PREFIX: a death before a sync landed loses its stage, and without a checkpoint training "
                         "would start again from iteration 0")


def check_redundancy(args) -> None:
    """--redundancy off survives a death only by redoing the iteration from a peer
    pipeline's copy of the lost stage, which needs agents and two pipelines."""
    if args.redundancy == JobRedundancy.AUTO and args.local_nodes is None and args.stages > 1:
        raise ValueError("--redundancy auto needs agents (--local-nodes N): they choose the mode between iterations")
    if args.frc == Frc.ALL and args.redundancy in (Redundancy.LAZY, Redundancy.OFF):
        raise ValueError(f"--frc all with --redundancy {args.redundancy}: only eager runs FRC before a failure "
                         "(use --redundancy eager or auto, or leave --frc out)")
    if args.sync_bucket_mb <= 0:
        raise ValueError(f"--sync-bucket-mb must be a positive number of MB (got {args.sync_bucket_mb})")
    if args.auto_prior_rate < 0 or args.auto_prior_hours <= 0:
        raise ValueError(f"--auto-prior-rate must not be negative and --auto-prior-hours must be positive "
                         f"(got {args.auto_prior_rate} and {args.auto_prior_hours})")
    if args.redundancy != Redundancy.OFF or args.stages == 1:
        return
    if args.preempt and args.local_nodes is None:
        raise ValueError("--preempt with --redundancy off and no agents: no node holds the killed node's layers, "
                         "so the job would end; use --redundancy eager or lazy, or --local-nodes with 2+ pipelines")
    if args.local_nodes is not None and args.local_nodes < 2 * args.stages and not args.checkpoint:
        raise ValueError(f"--redundancy off with agents needs 2 pipelines (--local-nodes {2 * args.stages} or more) "
                         "to redo an iteration from a peer's copy, or --checkpoint to restore from; else one death "
                         "restarts training from iteration 0")


def check_stages_per_node(args) -> None:
    """--max-stages-per-node: 1 or 2 (the compiler runs a short pipeline's node on
    two stages as a failed node merged into its predecessor, and merges one only)."""
    most = args.max_stages_per_node
    if not 1 <= most <= 2:
        raise ValueError(f"--max-stages-per-node must be 1 or 2 (got {most}): a node runs its own stage and at most "
                         "one more, which the compiler merges into it as it merges a failed successor")


def check_fit(args) -> None:
    """Enough local nodes to hold every stage at --max-stages-per-node each."""
    most = args.max_stages_per_node
    if args.local_nodes is not None and args.stages > 1 and args.local_nodes < -(-args.stages // most):
        raise ValueError(f"{args.stages} stages cannot fit on {args.local_nodes} nodes at --max-stages-per-node "
                         f"{most}: it needs {-(-args.stages // most)} nodes or more")


def check_precision(args, cuda_here: bool = True) -> None:
    """fp16 needs CUDA where the job runs: this machine's is checked only when it is
    that machine (a cloud launch's nodes are checked by their type, cloud/)."""
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cuda_here and args.precision == Precision.FP16 and not fp16_allowed(here):
        raise ValueError("--precision fp16 needs CUDA (fp16 with a dynamic loss scale is for GPUs); "
                         "on the CPU use --precision bf16")
    if args.precision != Precision.FP32 and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} keeps float32 master weights: use --dtype float32 "
                         f"(got {args.dtype})")


def read_model_config(args) -> str | None:
    """--model-config's text: every worker gets it with the job's settings."""
    if not args.model_config:
        return None
    if args.model != "tiny" and not args.model.startswith("hf"):
        raise ValueError(f"--model-config names the model: leave out --model {args.model!r}")
    try:
        with open(args.model_config) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--model-config {args.model_config!r}: cannot read it ({e.strerror})") from None


def check_data(args, source: ModelSource, fetch: bool = True, objects: bool = True) -> None:
    """The data fit the model and the evaluation, checked before any process starts
    (a token file is scanned once, here, for ids outside the vocabulary). Objects
    are fetched into this machine's cache, or with `fetch` False (bamboo-launch:
    the nodes fetch them) only checked to exist, or with `objects` False (a plan,
    an estimate: no credentials needed) not read at all."""
    if args.val_data and args.val_fraction is not None:
        raise ValueError("--val-data and --val-fraction: validate on a file or on the data's tail, not both")
    args.val_fraction = (0.0 if args.val_data else 0.05) if args.val_fraction is None else args.val_fraction
    if not 0 <= args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be at least 0 and below 1 (got {args.val_fraction})")
    if args.eval_every < 0 or args.eval_batches < 1:
        raise ValueError(f"--eval-every must not be negative and --eval-batches must be at least 1 "
                         f"(got {args.eval_every} and {args.eval_batches})")
    if not objects:
        return
    args.data, args.val_data = expand(args.data), expand(args.val_data)
    if shared := sorted(set(args.data) & set(args.val_data)):
        raise ValueError(f"--data and --val-data both name {shared[0]}: validation would see trained samples")
    if not fetch and any(map(is_remote, (*args.data, *args.val_data))):
        return check_objects(args, source)
    found = corpora(args.data, args.val_data, args.token_dtype, source.seq, args.batch, args.seed, args.val_fraction)
    for corpus in found:
        corpus.check_vocabulary(source.vocab, args.model_config or args.model)
    if args.eval_every:
        found[0].check_validation()


def check_objects(args, source: ModelSource) -> None:
    """Each object exists, a raw token file's size is a whole number of ids, and
    shards fit the model (from their headers: nothing is downloaded)."""
    from bamboo.data.cache import stat
    itemsize = np.dtype(TOKEN_DTYPES[args.token_dtype]).itemsize
    for files in (args.data, args.val_data):
        check_files(files)
    check_remote_shards([f for f in (*args.data, *args.val_data) if is_remote(f) and is_shard(f)], source.vocab,
                        args.model_config or args.model)
    for files in (args.data, args.val_data):
        for uri in (f for f in files if is_remote(f) and not is_shard(f)):  # shards: stat'ed with their header
            size = stat(uri).size
            if is_token_file(uri) and size % itemsize:
                raise ValueError(f"token file {uri} has {size} bytes, not a whole number of {args.token_dtype} ids "
                                 f"({itemsize} bytes each): is --token-dtype right?")


def check_etcd(args) -> None:
    """--etcd is HOST:PORT[,...]; --etcd-members asks for an embedded cluster
    (so not beside --etcd: that etcd is the user's)."""
    from bamboo.control.etcd import EtcdError, check_member_count, parse_endpoints
    try:
        if args.etcd is not None:
            parse_endpoints(args.etcd)
        check_member_count(args.etcd_members)
    except EtcdError as e:
        raise ValueError(str(e)) from None
    if args.etcd is not None and args.etcd_members != 1:
        raise ValueError(f"--etcd-members {args.etcd_members} starts an etcd of bamboo-train's own: with --etcd "
                         "the etcd is yours (give all its members to --etcd instead)")
    if args.etcd_tls is not None:
        ClientFiles.in_dir(args.etcd_tls)  # CredentialError (a ValueError) names the missing file


def etcd_notes(args) -> list[str]:
    """--etcd-tls (else $BAMBOO_ETCD_TLS) goes with --etcd; without it, a note.
    (An etcd used in the clear is named by the launcher, once it answered.)"""
    args.etcd_tls = args.etcd_tls or (os.environ.get(TLS_ENV) if args.etcd is not None else None)
    if args.etcd is None and args.etcd_tls:
        return ["--etcd-tls does nothing in this run: the embedded etcd makes its own credentials"]
    return []


def run_name() -> str:
    """This run's name in its checkpoints' folders: the start time in hex, then a
    random part, so that a later run's sort after an earlier one's."""
    return f"{int(time.time()):08x}{secrets.token_hex(2)}"


def config_from_args(args, remote: bool = False, objects: bool = True) -> JobConfig:
    """The job's config from the parsed flags, every check done. `remote`: the job
    runs on other machines (bamboo-launch), which fetch the data and own the GPUs;
    `objects` False: its data and checkpoint objects are not read (a plan)."""
    if args.local_nodes is not None:
        args.pipelines = start_pipelines(args)
    check_on_face(args)
    check_recipe(args)
    check_stages_per_node(args)
    check_precision(args, cuda_here=not remote)
    model_config = read_model_config(args)
    source = ModelSource(args.model, args.seed, seq=args.seq, config_json=model_config)
    layers = source.count
    name = f"--model-config {args.model_config}" if model_config else f"model {args.model}"
    if objects:
        check_checkpoint(args.checkpoint)
    check_data(args, source, fetch=not remote, objects=objects)
    if args.stages > layers:
        raise ValueError(f"--stages {args.stages} is more than {name}'s {layers} layers")
    check_replica_sync(args)
    check_fit(args)
    if args.microbatches < args.pipelines:
        raise ValueError(f"--microbatches {args.microbatches} is fewer than --pipelines {args.pipelines}")
    check_checkpoint_flags(args)
    check_liveness(args)
    check_etcd(args)
    if args.stages == 1 and (args.checkpoint or args.resume):
        raise ValueError("checkpoints need a pipeline (--stages 2 or more)")
    if args.stages == 1 and args.pipelines > 1:
        raise ValueError("--stages 1 is the single-process reference: use --pipelines 1")
    preempt = parse_preempts(args.preempt, args) if args.stages > 1 else ()
    check_redundancy(args)
    parsed_devices = devices.parse_devices(args.devices)
    if args.transport == Transport.NCCL and args.share_gpu:
        raise ValueError("--transport nccl cannot share a GPU between workers: drop --share-gpu or use gloo")
    check_outputs(args)  # last: it may create the directories
    return JobConfig(
        model=section(ModelSpec, args, name="hf:config" if model_config else args.model, config_json=model_config,
                      layers=layers),
        schedule=section(ScheduleSpec, args), recipe=section(RecipeSpec, args, betas=tuple(args.betas)),
        data=section(DataSpec, args, data_files=tuple(args.data), val_files=tuple(args.val_data)),
        checkpoints=section(CheckpointSpec, args, run=run_name(), memory_copies=not args.no_memory_copies),
        faults=section(FaultSpec, args), devices=section(DeviceSpec, args, names=parsed_devices),
        cluster=section(ClusterSpec, args, job=args.job or "job", elastic=args.local_nodes is not None),
        testing=section(TestingSpec, args, preempt=preempt))


def section(kind, args, **derived):
    """A section of the job's config: each field from its flag's value, those that
    config.DERIVED names from `derived` (a test checks that the two cover every field)."""
    return kind(**{f.name: getattr(args, f.name) for f in dataclasses.fields(kind) if f.name not in derived}, **derived)


def _terminate(signum, frame):
    from commands.train.launcher import INTERRUPTED
    INTERRUPTED.set()  # seen by the launcher's loops even if an etcd call swallowed the exception
    raise KeyboardInterrupt  # the same cleanup as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    args = jobfile.parse_args(build_parser(), argv)
    try:
        plan_report.check_flags(args)
        local_hosts(args)
        cfg = config_from_args(args)
        if args.plan:
            nodes = args.local_nodes if args.local_nodes is not None else cfg.schedule.nodes
            return plan_report.run_plan(args, cfg, nodes, plan_report.target_of(args, args.workers_per_host or 1))
        local = local_cluster(args)
        notes = idle_notes(args) + (etcd_notes(args) if cfg.schedule.stages > 1 else [])
        if cfg.schedule.stages > 1:  # every worker runs on this host: can each have its device?
            workers = local.nodes + sum(c for c, _ in local.joins) if local else cfg.schedule.nodes
            devices.check_flags(args.devices, args.share_gpu, args.transport, workers)
            if args.share_gpu and (why := devices.share_note(args.devices, workers)):
                notes.append(f"--share-gpu does nothing in this run: {why}")
        else:  # the single-process run computes on the first worker's device: it must exist
            devices.check_flags(args.devices, True, "gloo", 1)
    except ValueError as e:
        print(f"bamboo-train: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"bamboo-train: note: {note}", file=sys.stderr)
    layers = tempfile.mkdtemp(prefix="bamboo-export-") if args.export and not cfg.checkpoints.save_dir else None
    cfg = cfg.with_(save_dir=cfg.checkpoints.save_dir or layers)
    try:
        if cfg.schedule.stages == 1:
            from commands.train.single import run_single
            run_single(cfg, args.metrics_out, progress=not args.no_progress, sinks=metric_sinks(args))
        else:
            from commands.train.launcher import Launcher
            launcher = Launcher(cfg, args.etcd, args.metrics_out, progress=not args.no_progress, cluster=local,
                                named=args.job is not None, sinks=metric_sinks(args), etcd_members=args.etcd_members)
            launcher.logs, launcher.etcd_tls = args.log_dir, args.etcd_tls
            summary = launcher.run()
            print(json.dumps(summary))
        if args.export:
            from bamboo.model.export import export
            export(cfg.checkpoints.save_dir, args.export, ModelSource.of(cfg.model))
    except KeyboardInterrupt:
        print("bamboo-train: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- one line, not a traceback wall
        print(f"bamboo-train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if layers:
            shutil.rmtree(layers, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
