"""Grow the job's group when its agents ask for more nodes than it has (the surplus
rule's standby after a burst; agents/release.py), as the node's own identity:

    python -m cloud.group_size ec2 --region R --group NAME --desired N [--endpoint-url URL]
    python -m cloud.group_size gcp --project P --region R --group NAME --desired N

EC2 sets the Auto Scaling group's desired capacity (SetDesiredCapacity, at most its
maximum); GCP resizes the regional managed instance group (from its target size).
The agents never ask for more than the group's size at their first decision. It only grows: a
release lowers the group by leaving it (cloud/node_exit.py, one smaller), and a
preempted node is replaced by the group itself. It takes cloud.node_exit's
arguments too (the boot script passes the same ones) and ignores those it does
not use. Bad arguments are one line and exit 2; a cloud's error is one line and
exit 1.
"""
from __future__ import annotations

import argparse
import sys

from bamboo.control.parser import OneLineParser
from cloud.node_exit import node_client


def grow_ec2(args) -> int:
    scaling = node_client("autoscaling", args.region, args.endpoint_url)
    groups = scaling.describe_auto_scaling_groups(AutoScalingGroupNames=[args.group])["AutoScalingGroups"]
    if not groups:
        raise LookupError(f"no autoscaling group {args.group!r} in {args.region}")
    now, most = groups[0]["DesiredCapacity"], groups[0]["MaxSize"]
    wanted = min(args.desired, most)
    if wanted > now:
        scaling.set_desired_capacity(AutoScalingGroupName=args.group, DesiredCapacity=wanted, HonorCooldown=False)
    return max(now, wanted)


def grow_gcp(args) -> int:
    from cloud.gcp import GcpProvider
    provider = GcpProvider(args.project, args.region, args.endpoint_url)
    now = provider.target_size(args.group)  # not the instances listed: some may still be coming
    if args.desired > now:
        provider.scale(args.group, args.desired)
    return max(now, args.desired)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="cloud.group_size", description=__doc__.splitlines()[0])
    ap.add_argument("cloud", choices=("ec2", "gcp"))
    ap.add_argument("--region", required=True, help="the group's region")
    ap.add_argument("--group", required=True, help="the job's group")
    ap.add_argument("--desired", type=int, required=True, help="the nodes the job asks for")
    ap.add_argument("--project", help="gcp: the project")
    ap.add_argument("--endpoint-url", help="the cloud API's endpoint (a local server in tests)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args, _ = build_parser().parse_known_args(argv)  # cloud.node_exit's other arguments ride along
    if args.desired < 1:
        print(f"cloud.group_size: error: --desired must be at least 1 (got {args.desired})", file=sys.stderr)
        return 2
    if args.cloud == "gcp" and not args.project:
        print("cloud.group_size: error: gcp needs --project", file=sys.stderr)
        return 2
    try:
        size = grow_ec2(args) if args.cloud == "ec2" else grow_gcp(args)
    except Exception as e:  # noqa: BLE001 -- any cloud error: one line
        print(f"cloud.group_size: error: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 1
    print(f"cloud.group_size: {args.group} asks for {size} nodes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
