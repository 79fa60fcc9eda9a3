"""The training job a cloud launch configures. Its arguments are bamboo-train's
own, parsed and checked by bamboo-train's own code (commands/train/cli.py) before any
cloud or storage request, and the result is written where `bamboo-train
--local-nodes` writes it: the job's CONFIG key, which booting agents wait for.
"""
from __future__ import annotations

import json

from cloud.common import BadInput, LaunchError
from bamboo.control.config import JobConfig
from bamboo.control.protocol import CONFIG, job_root

# bamboo-train flags a cloud launch owns itself, or that only make sense beside a
# launcher process on this machine (a cloud job has none: bamboo-status shows it).
NOT_FOR_CLOUD = {
    "--local-nodes": "--nodes sets the job's nodes",
    "--local-hosts": "--nodes sets the job's machines; each runs a worker per GPU of its type",
    "--workers-per-host": "each machine runs a worker per GPU of its instance or machine type",
    "--join": "bamboo-launch scale N adds nodes",
    "--notice": "the nodes watch their cloud's notices",
    "--metadata-url": "the nodes ask their own metadata server",
    "--metrics-out": "no launcher process writes metrics for a cloud job: watch it with bamboo-status",
    "--plot": "no launcher process draws a cloud job: watch it with bamboo-status",
    "--tensorboard": "no launcher process writes a cloud job's scalars: watch it with bamboo-status",
    "--export": "a cloud job's parameters stay in its --checkpoint",
    "--save-dir": "each node would write its own disk: use --checkpoint s3://... or gs://...",
    "--resume": "a cloud job continues from its --checkpoint prefix's newest checkpoint by itself",
    "--etcd": "give the launch's own --etcd",
    "--log-dir": "a cloud job's logs stay on its nodes",
    "--local-prefix": "it wraps the agents of a local job",
    "--no-progress": "no launcher process shows a cloud job's progress: watch it with bamboo-status",
}
# a job file's bamboo-train keys that a launch gives itself, in its [launch] section
LAUNCH_OWNS = {"--job": "name the job in [launch] (or bamboo-launch --job)",
               "--zones": "the nodes' zones go in [launch] (or bamboo-launch --zones)",
               "--etcd-members": "the etcd members go in [launch] (or bamboo-launch --etcd-members, with --etcd auto)"}
REMOTE = ("s3://", "gs://")


def check_flags(train_argv: list[str]) -> None:
    """Refuse the flags of NOT_FOR_CLOUD, as argparse would read them: a unique
    prefix (`--metrics-o`) is the flag it abbreviates."""
    from commands.train.flags import flag_named
    for arg in train_argv:
        flag = flag_named(arg)
        if flag in NOT_FOR_CLOUD:
            raise BadInput(f"{flag} is not for a cloud job: {NOT_FOR_CLOUD[flag]}")


def check_file_flags(path: str, file_argv: list[str], keys: dict) -> None:
    """A --config file's training keys: what check_flags refuses on the command
    line, and those a launch gives itself. `keys`: section and key, by flag."""
    for token in file_argv:
        flag = token.split("=", 1)[0]
        why = NOT_FOR_CLOUD.get(flag) or LAUNCH_OWNS.get(flag)
        if why:
            raise BadInput(f"{path}: {keys[flag]} is not for a cloud job: {why}")


def check_remote(args) -> None:
    """Nodes cannot read this machine's files: data and checkpoints must be objects
    (s3:// or gs://) that every node reads with its own credentials."""
    for path in (*args.data, *args.val_data):
        if not path.startswith(REMOTE):
            raise BadInput(f"--data/--val-data {path!r}: a cloud job's nodes cannot read this machine's files; "
                           f"upload it and give s3://BUCKET/KEY or gs://BUCKET/KEY")
    if args.checkpoint and not args.checkpoint.startswith(REMOTE):
        raise BadInput(f"--checkpoint {args.checkpoint!r}: every node must reach it; give s3://BUCKET/PREFIX "
                       f"or gs://BUCKET/PREFIX")


def check_checkpoints(cfg: JobConfig) -> list[str]:
    """A cloud job's --checkpoint prefix holds no other job's checkpoints (BadInput);
    the warnings to print (a job without checkpoints)."""
    location = cfg.checkpoints.checkpoint
    if not location:
        return ["no --checkpoint: a burst that takes a stage from every node ends the job, and no model can be "
                "taken out of it afterwards (bamboo-export reads checkpoints)"]
    from bamboo.data.checkpoint_files import commit_record, committed, storage_for
    storage = storage_for(location)
    try:
        attempts = committed(storage)
    except ValueError as e:  # objects.ObjectError: listed once already; unreachable now
        raise BadInput(str(e).splitlines()[0]) from None
    for attempt in attempts:
        record = commit_record(storage, attempt) or {}
        if record.get("job") != cfg.cluster.job:
            owner = f"job {record['job']!r}" if isinstance(record.get("job"), str) else "a job that named none"
            raise BadInput(f"--checkpoint {location}: holds checkpoints of {owner} ({attempt.folder}): give job "
                           f"{cfg.cluster.job!r} a prefix of its own")
    return []


def continued(cfg: JobConfig) -> tuple[JobConfig, str | None]:
    """A relaunch of a job whose --checkpoint prefix holds its own checkpoints
    (check_checkpoints refused any other's) continues from the newest committed
    one: the config resumes, and the note says from where."""
    location = cfg.checkpoints.checkpoint
    if not location:
        return cfg, None
    from bamboo.data.checkpoint_files import newest_listed, storage_for
    try:
        found = newest_listed(storage_for(location), cfg.model.layers)
    except ValueError as e:  # objects.ObjectError: listed once already; unreachable now
        raise BadInput(str(e).splitlines()[0]) from None
    if found is None:
        return cfg, None
    return cfg.with_(resume=True), (f"job {cfg.cluster.job!r} continues from its newest checkpoint in {location}, "
                                    f"taken before iteration {found}")


def job_config(train_argv: list[str], nodes: int, job: str) -> JobConfig:
    """bamboo-train's checks over `train_argv` (and the job file it names with
    --config), for `nodes` agents (as --local-nodes)."""
    return job_args(train_argv, nodes, job)[1]


def job_args(train_argv: list[str], nodes: int, job: str, objects: bool = True):
    """bamboo-train's parsed flags, and the job's config from them (job_config);
    `objects` False: the data and checkpoint objects are not read (a plan)."""
    from commands.train import cli, flags, jobfile, plan_report
    check_flags(train_argv)
    parser = flags.build_parser()
    parser.prog = "bamboo-launch"  # its usage errors: one line, status 2
    path = jobfile.config_path(train_argv)  # --config: its [launch] section went to bamboo-launch's parser
    file = jobfile.read(parser, path) if path is not None else jobfile.FileArgs([], {})
    check_file_flags(path, file.argv, jobfile.where(parser))
    args = jobfile.parse_args(parser, [*train_argv, "--job", job, "--local-nodes", str(nodes)], file)
    check_remote(args)
    try:
        plan_report.check_flags(args)
        cfg = cli.config_from_args(args, remote=True, objects=objects)  # the nodes fetch the objects
        cli.local_cluster(args)  # the --local-nodes checks: nodes >= stages
    except ValueError as e:
        raise BadInput(str(e).replace("--local-nodes", "--nodes")) from None  # its checks name our flag
    return args, cfg


def config_key(job: str) -> str:
    """The raw etcd key agents wait for (Cluster.key(CONFIG()))."""
    return job_root(job) + CONFIG().path


def config_request(endpoint: str, cfg: JobConfig) -> dict:
    """The etcd write, as --dry-run prints it."""
    return {"service": "etcd", "operation": "put_if_not_exists", "endpoint": endpoint,
            "key": config_key(cfg.cluster.job), "value": cfg.to_dict()}


class JobStore:
    """The job's keys in its etcd: checked absent, written once, removed on roll-back
    and on `down`."""

    def __init__(self, endpoint: str, job: str, dry_run: bool = False, log=print):
        self.endpoint, self.job, self.dry_run, self.log = endpoint, job, dry_run, log
        self.cluster = None
        if dry_run:
            return
        from bamboo.control.cluster import Cluster
        from bamboo.control.etcd import EtcdError
        try:
            self.cluster = Cluster(endpoint, job, patience=5.0)
        except EtcdError as e:
            raise LaunchError(str(e)) from None

    def check_absent(self) -> None:
        if self.cluster and self.cluster.get(CONFIG()) is not None:
            raise LaunchError(f"job {self.job!r} exists already in etcd {self.endpoint}: pick another --job "
                              f"(or remove that one with bamboo-launch down)")

    def write(self, cfg: JobConfig) -> None:
        if self.dry_run:
            self.log(json.dumps(config_request(self.endpoint, cfg), default=str))
            return
        if not self.cluster.create(CONFIG(), cfg):
            raise LaunchError(f"job {self.job!r} was configured in etcd {self.endpoint} meanwhile")

    def remove(self) -> None:
        """Every key of the job (and of its agents' rendezvous)."""
        from bamboo.control.protocol import rendezvous_prefix
        if self.cluster:
            self.cluster.call(lambda: self.cluster.client.delete_prefix(job_root(self.job)))
            self.cluster.call(lambda: self.cluster.client.delete_prefix(rendezvous_prefix(self.job)))

    def close(self) -> None:
        if self.cluster:
            self.cluster.close()
