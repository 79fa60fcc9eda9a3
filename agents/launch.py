"""`bamboo-launch`: get spot nodes for a job from a cloud, each running bamboo-agent.

    bamboo-launch ec2 --nodes N --zones Z1,Z2,.. --region R --image AMI --etcd HOST:PORT|auto --job NAME
                      [--instance-type T] [--key-name K] [--security-group SG ..] [--iam-profile P] [--dry-run]
    bamboo-launch gcp --nodes N --zones Z1,Z2,.. --project P --region R --image IMAGE --etcd HOST:PORT --job NAME
                      [--machine-type T] [--dry-run]
    bamboo-launch status | scale N | down       (the launch recorded in --state)

`--etcd auto` (EC2) first starts a small on-demand instance running etcd in the
first zone and points the agents at it; otherwise give your own etcd endpoint.
What was launched is recorded in a state file (`--state`, default
.bamboo-launch.json, written atomically) for status, scale and down. `--dry-run`
prints every API request, one JSON line each, and sends none. Credentials come
from the standard boto3 / Google auth chains and are never printed. Errors are
one line on stderr, exit status 1 (2 for bad arguments).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from agents.cloud import DISTRIBUTION, LaunchError
from agents.ec2 import Ec2Provider, Ec2Spec


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"bamboo-launch: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bamboo-launch", description=__doc__.splitlines()[0])
    p.add_argument("--state", default=".bamboo-launch.json", help="where the launch is recorded")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for cloud in ("ec2", "gcp"):
        c = sub.add_parser(cloud, help=f"launch spot nodes on {cloud.upper()}")
        c.add_argument("--nodes", type=int, required=True)
        c.add_argument("--zones", required=True, help="zones, comma-separated")
        c.add_argument("--region", required=True)
        c.add_argument("--image", required=True)
        c.add_argument("--etcd", required=True, help="HOST:PORT, or 'auto' (EC2) to launch an etcd node")
        c.add_argument("--job", required=True)
        c.add_argument("--name", default="bamboo", help="name of the template and the group")
        c.add_argument("--package", default=DISTRIBUTION, help="what the nodes pip-install (a pip requirement)")
        c.add_argument("--endpoint-url", help="the API endpoint (tests point it at a local server)")
        c.add_argument("--dry-run", action="store_true")
        c.add_argument("--state", default=argparse.SUPPRESS)
        if cloud == "ec2":
            c.add_argument("--instance-type", default="p3.2xlarge")
            c.add_argument("--key-name")
            c.add_argument("--security-group", action="append", default=[])
            c.add_argument("--iam-profile")
        else:
            c.add_argument("--project", required=True)
            c.add_argument("--machine-type", default="n1-standard-8")
    for name in ("status", "down"):
        s = sub.add_parser(name)
        s.add_argument("--state", default=argparse.SUPPRESS)
    s = sub.add_parser("scale")
    s.add_argument("nodes", type=int)
    s.add_argument("--state", default=argparse.SUPPRESS)
    return p


def write_state(path: str, state: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def read_state(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LaunchError(f"no launch recorded in {path} (run bamboo-launch ec2|gcp first, or pass --state)") from None
    except ValueError:
        raise LaunchError(f"{path} is not a launch record") from None


def provider_for(state: dict, dry_run: bool = False):
    if state["provider"] == "ec2":
        return Ec2Provider(state["region"], state.get("endpoint_url"), dry_run)
    from agents.gcp import GcpProvider
    return GcpProvider(state["project"], state["region"], state.get("endpoint_url"), dry_run)


def launch(args) -> dict:
    zones = tuple(z.strip() for z in args.zones.split(",") if z.strip())
    if args.nodes < 1 or not zones:
        raise LaunchError("--nodes must be at least 1 and --zones must name a zone")
    if args.command == "ec2":
        provider = Ec2Provider(args.region, args.endpoint_url, args.dry_run)
        spec = Ec2Spec(name=args.name, region=args.region, zones=zones, nodes=args.nodes, image=args.image,
                       etcd=args.etcd, job=args.job, instance_type=args.instance_type, key_name=args.key_name,
                       security_groups=tuple(args.security_group), iam_profile=args.iam_profile,
                       package=args.package)
        if args.etcd == "auto":
            provider.subnets(zones)  # the zones are checked before anything is started
            spec = Ec2Spec(**{**spec.__dict__, "etcd": provider.etcd_node(spec, zones[0])})
        made = provider.up(spec)
    else:
        from agents.gcp import GcpProvider, GcpSpec
        if args.etcd == "auto":
            raise LaunchError("--etcd auto is EC2 only: give the etcd endpoint for a GCP job")
        provider = GcpProvider(args.project, args.region, args.endpoint_url, args.dry_run)
        made = provider.up(GcpSpec(name=args.name, project=args.project, region=args.region, zones=zones,
                                   nodes=args.nodes, image=args.image, etcd=args.etcd, job=args.job,
                                   machine_type=args.machine_type, package=args.package))
        made["project"] = args.project
    made["endpoint_url"] = args.endpoint_url
    made["etcd"] = spec.etcd if args.command == "ec2" else args.etcd
    return made


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("ec2", "gcp"):
            made = launch(args)
            if not args.dry_run:
                write_state(args.state, made)
                print(json.dumps(made))
            return 0
        state = read_state(args.state)
        provider = provider_for(state)
        if args.command == "status":
            print(json.dumps({**state, "instances": provider.describe(state["name"])}))
        elif args.command == "scale":
            provider.scale(state["name"], args.nodes)
        else:
            provider.down(state["name"])
            os.unlink(args.state)
    except LaunchError as e:
        print(f"bamboo-launch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
