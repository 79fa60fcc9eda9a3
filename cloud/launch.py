"""`bamboo-launch`: one command from this machine to a training job on spot nodes.

    bamboo-launch ec2 --nodes N --zones Z1,Z2,.. --region R --image AMI --etcd HOST:PORT,..|auto --job NAME
                      (--bucket BUCKET[/PREFIX] | --package REQUIREMENT) [--instance-type T ..] [--key-name K]
                      [--security-group SG ..] [--iam-profile P] [--etcd-plain] [--dry-run] [bamboo-train options]
    bamboo-launch gcp --nodes N --zones Z1,Z2,.. --project P --region R --image IMAGE --etcd HOST:PORT|auto
                      --job NAME (--bucket BUCKET[/PREFIX] | --package REQUIREMENT) [--machine-type T]
                      [--accelerator TYPE[:COUNT]|none] [--service-account EMAIL] [--etcd-plain] [--dry-run]
                      [bamboo-train options]
    bamboo-launch ec2|gcp ... --plan | --estimate [--preemption-rate R] [--zone-bursts S] [--burst-hours H]
                      [--boot-minutes M] [--estimate-hours H] [--prices FILE.json]   (print and exit: nothing sent)
    bamboo-launch status [JOB] | dashboard [JOB] | scale [JOB] N | down [JOB]   (a launch recorded in --state)
                  [--via auto|direct|ssm|gcloud|ssh [--ssh-host USER@HOST] [--ssh-key FILE]]   (status, dashboard)

The bamboo-train options (--model, --stages, --microbatches, --iterations, the
recipe, --data and --checkpoint as s3:// or gs:// URIs, ...) are checked by
bamboo-train's own code before any request, and the job's configuration is
written to its etcd before the nodes boot. The nodes install a wheel of this
project, uploaded to --bucket and fetched through a presigned (S3) or signed
(GCS) URL, or --package, a direct reference. `--etcd auto` starts a small
on-demand instance running etcd, which writes the configuration itself
(`--etcd-members 3`: three, one in each of the first three zones, and the
nodes' agents get all three endpoints); it serves TLS only, with etcd auth, and
every instance fetches its certificates of the job's own CA from the bucket with
its own identity (cloud/etcd_tls.py; `--etcd-plain`: none of that). What was
launched is recorded in --state (default .bamboo-launch.json, written atomically),
one record per job (cloud/records.py), for status, scale and down. `--dry-run` prints every request (cloud, storage,
etcd), one JSON line each, and sends none. Errors are one line on stderr, exit
status 1 (2 for bad arguments); a launch that fails removes what it created. A
launch ends by printing, on stderr, the command that opens the job's dashboard
(`bamboo-launch dashboard JOB`: through a tunnel to its etcd where one is needed,
cloud/watch.py; `status` reads the progress the same way).
`--config FILE.toml` (docs/job-file.md) gives the options from a job file: its
[launch] section these, its other sections bamboo-train's; the command line wins.
"""
from __future__ import annotations

import argparse
import json
import sys

from bamboo.control.parser import OneLineParser
from cloud import estimating
from cloud.common import BadInput, LaunchError
from cloud.manage import DEFAULT_STATE
from cloud.records import check_unrecorded, pick, read_records, write_records
from commands.train import jobfile

CLOUDS = ("ec2", "gcp")
STATE_HELP = "where the launches are recorded, one record per job (default .bamboo-launch.json)"
JOB_HELP = "the job's name (--job at launch); may be left out when the file records one job"


class _Parser(OneLineParser):
    def __init__(self, *a, **kw):
        super().__init__(*a, allow_abbrev=False, **kw)  # never take a bamboo-train flag for one of ours

    def error(self, message: str) -> None:
        print(f"bamboo-launch: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _cloud_parser(sub, cloud: str) -> argparse.ArgumentParser:
    c = sub.add_parser(cloud, help=f"launch a job on {cloud.upper()} spot nodes (and any bamboo-train option)")
    _launch_flags(jobfile.add_section(c, jobfile.LAUNCH, "launch"), cloud)
    estimating.add_flags(c)
    return c


def _launch_flags(c, cloud: str) -> None:
    c.add_argument("--nodes", type=int, required=True, help="spot nodes to ask for (the group's size)")
    c.add_argument("--zones", required=True, help="zones, comma-separated")
    c.add_argument("--region", required=True, help="the cloud region of the nodes, etcd and bucket")
    c.add_argument("--image", required=True,
                   help="the nodes' machine image: an AMI id, or a GCP image (one with Python 3.10+ and the "
                        "GPU driver; docs/cloud.md)")
    c.add_argument("--etcd", required=True, help="HOST:PORT[,HOST:PORT...], or 'auto' to launch etcd instances")
    c.add_argument("--etcd-plain", action="store_true",
                   help="with --etcd auto: no TLS or auth on the job's etcd (by default its members, nodes and "
                        "your status commands use the job's own certificates, docs/security.md)")
    c.add_argument("--etcd-members", type=int, default=1, metavar="N",
                   help="with --etcd auto: N on-demand etcd instances (1, 3, 5 or 7), one per zone of --zones")
    c.add_argument("--job", required=True, help="the job's name: its etcd keys, bucket prefix and labels")
    c.add_argument("--name", default="bamboo", help="name of the template and the group")
    c.add_argument("--bucket", metavar="BUCKET[/PREFIX]", help="where the project's wheel is uploaded")
    c.add_argument("--package", help="what the nodes pip-install instead: a URL, NAME @ URL or git+URL")
    c.add_argument("--endpoint-url", help="the API endpoint (tests point it at a local server)")
    c.add_argument("--dry-run", action="store_true",
                   help="print every cloud request as a JSON line and send none (the data objects are still "
                        "checked, and the wheel is built, here)")
    c.add_argument("--state", default=argparse.SUPPRESS, help=STATE_HELP)
    if cloud == "ec2":
        c.add_argument("--instance-type", action="append", metavar="T",
                       help="repeatable; default: several one-GPU types (cloud/ec2.py GPU_TYPES)")
        c.add_argument("--key-name", help="an EC2 key pair the nodes admit for SSH")
        c.add_argument("--security-group", action="append", default=[],
                       help="repeatable; added to the job's own group (which admits only the job's instances): "
                            "one that admits your SSH, say")
        c.add_argument("--iam-profile",
                       help="the nodes' instance profile: their access to the job's buckets (docs/cloud.md)")
    else:
        c.add_argument("--project", required=True, help="the GCP project")
        c.add_argument("--machine-type", default="n1-standard-8", help="the nodes' machine type")
        c.add_argument("--accelerator", metavar="TYPE[:COUNT]|none",
                       help="the GPUs attached to each node (default: none for machine types that come with "
                            "theirs, a2, a3 and g2; else nvidia-tesla-t4:1)")
        c.add_argument("--storage-endpoint-url", help="the GCS endpoint (tests)")
        c.add_argument("--service-account", default="default", metavar="EMAIL",
                       help="the nodes' identity (default: the project's default compute account); give one "
                            "with access to the job's buckets only")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bamboo-launch", description=__doc__.splitlines()[0])
    p.add_argument("--state", default=DEFAULT_STATE, help=STATE_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cloud in CLOUDS:
        _cloud_parser(sub, cloud)
    s = sub.add_parser("down", help="a launched job's teardown")
    s.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
    s.add_argument("--state", default=argparse.SUPPRESS, help=STATE_HELP)
    for name, what in (("status", "a launched job's instances and progress"),
                       ("dashboard", "a launched job's live dashboard, served on this machine's loopback")):
        s = sub.add_parser(name, help=what)
        s.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
        s.add_argument("--state", default=argparse.SUPPRESS, help=STATE_HELP)
        _tunnel_flags(s, dashboard=name == "dashboard")
    s = sub.add_parser("scale", help="set a launched job's group size")
    s.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
    s.add_argument("nodes", type=int, help="the group's new size")
    s.add_argument("--state", default=argparse.SUPPRESS, help=STATE_HELP)
    return p


def _tunnel_flags(s, dashboard: bool) -> None:
    from cloud.watch import VIAS
    s.add_argument("--via", choices=VIAS, default="auto",
                   help="how to reach the job's etcd: directly, or through a tunnel (Session Manager, gcloud, ssh); "
                        "auto: ssm (EC2) or gcloud (GCP) to an --etcd auto instance, else directly")
    s.add_argument("--ssh-host", metavar="USER@HOST", help="with --via ssh: a machine that reaches the etcd")
    s.add_argument("--ssh-key", metavar="FILE", help="with --via ssh: the private key to log in with")
    if dashboard:
        s.add_argument("--port", type=int, default=8080, help="the dashboard's port on 127.0.0.1 (0: any free one)")
        s.add_argument("--no-browser", action="store_true", help="print the page's address, open no browser")
        s.add_argument("--seconds", type=float, metavar="S", help="stop after S seconds (default: at Ctrl-C)")


def _command_at(argv: list[str]) -> int:
    """Where the command word is: after the top-level options, of which only
    --state takes a value."""
    at = 0
    while at < len(argv) and argv[at].startswith("-"):
        at += 2 if argv[at] == "--state" else 1
    return at


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None):
    """The launch's own options and bamboo-train's, left over. --config is
    bamboo-train's flag (job_config reads the file's training sections); its
    [launch] section goes right after the command word, before the command line's
    options, so that these win."""
    argv = list(sys.argv[1:] if argv is None else argv)
    at = _command_at(argv)
    path = jobfile.config_path(argv[at + 1:]) if at < len(argv) and argv[at] in CLOUDS else None
    file = jobfile.FileArgs([], {})
    if path is not None:
        cloud = _cloud_parser(_Parser(prog="bamboo-launch").add_subparsers(parser_class=_Parser), argv[at])
        launch = dict(jobfile.load(cloud, path).get(jobfile.LAUNCH, {}))
        if any(a == "--state" or a.startswith("--state=") for a in argv[:at]):
            launch.pop("state", None)  # given before the command word: the command line still wins
        file = jobfile.to_argv(cloud, path, {jobfile.LAUNCH: launch} if launch else {})
    args, train_argv = parser.parse_known_args([*argv[:at + 1], *file.argv, *argv[at + 1:]])
    return jobfile.command_line_wins(args, file), train_argv


def launch(args, train_argv: list[str]) -> tuple[dict, list[str]]:
    """What was made, and the warnings to print once it stands. A relaunch into the
    job's own checkpoints continues from the newest (cloud.job.continued)."""
    from cloud.bringup import launch_ec2, launch_gcp
    from cloud.job import check_checkpoints, continued, job_config
    cfg = job_config(train_argv, args.nodes, args.job)  # bamboo-train's checks, before any request
    warnings = check_checkpoints(cfg)
    cfg, note = continued(cfg)
    if note:
        print(f"bamboo-launch: note: {note}", file=sys.stderr)
    return (launch_ec2 if args.command == "ec2" else launch_gcp)(args, cfg), warnings


def planned(args, train_argv: list[str]) -> int:
    """--plan: the job's plan against its instances' GPUs and host memory; no request sent."""
    from cloud.job import job_args
    from cloud.planning import target
    from commands.train import plan_report
    train, cfg = job_args(train_argv, args.nodes, args.job, objects=False)
    fits = target(args, train.gpu_memory, train.host_memory)
    try:
        return plan_report.run_plan(train, cfg, args.nodes, fits)
    except ValueError as e:
        raise BadInput(str(e)) from None


def launched(args, train_argv: list[str]) -> int:
    """Launch, then add the job's record to --state (refused first if it has one);
    or only plan, or only estimate."""
    from commands.train.flags import flag_named
    estimating.check_flags(args)
    plan = any(flag_named(a) == "--plan" for a in train_argv)
    if plan and args.estimate:
        raise BadInput("--plan and --estimate each print and exit: give one")
    if plan:
        return planned(args, train_argv)
    if args.estimate:
        return estimating.run_estimate(args, train_argv)
    check_unrecorded(args.state, args.job)
    made, warnings = launch(args, train_argv)
    for warning in warnings:
        print(f"bamboo-launch: warning: {warning}", file=sys.stderr)
    if not args.dry_run:
        from cloud.manage import watch_command
        write_records(args.state, {**read_records(args.state), made["job"]: made})
        print(json.dumps(made))
        print(f"bamboo-launch: watch the job: {watch_command(made, args.state)}", file=sys.stderr)
    return 0


def watched(args, state: dict) -> int:
    """status or dashboard, through the tunnel --via names."""
    from cloud.manage import status
    from cloud.watch import Tunnel, close_on_signals, dashboard
    close_on_signals()
    if (args.ssh_host or args.ssh_key) and args.via != "ssh":
        raise BadInput("--ssh-host and --ssh-key go with --via ssh")
    tunnel = Tunnel(state, args.via, args.ssh_host, args.ssh_key)
    if args.command == "status":
        print(json.dumps(status(state, tunnel)))
        return 0
    if not 0 <= args.port < 65536 or (args.seconds is not None and not args.seconds > 0):
        raise BadInput(f"--port must be 0 to 65535 and --seconds positive (got {args.port}, {args.seconds})")
    dashboard(state, tunnel, args.port, not args.no_browser, args.seconds)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, train_argv = parse(parser, argv)
    if train_argv and args.command not in CLOUDS:
        parser.error(f"unrecognized arguments: {' '.join(train_argv)}")
    try:
        if args.command in CLOUDS:
            return launched(args, train_argv)
        from cloud.manage import down, scale, status
        records = read_records(args.state)
        state = pick(records, args.job, args.state)
        if args.command in ("status", "dashboard"):
            return watched(args, state)
        elif args.command == "scale":
            scale(state, args.nodes)
            write_records(args.state, {**records, state["job"]: {**state, "nodes": args.nodes}})
        else:
            down(state)
            write_records(args.state, {j: r for j, r in records.items() if j != state["job"]})
    except BadInput as e:
        print(f"bamboo-launch: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"bamboo-launch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
