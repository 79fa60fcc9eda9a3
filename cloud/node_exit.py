"""What a cloud node does once its agent has exited, so that nothing is billed
after its work ends. The boot script (cloud/common.py) runs it with the agent's
exit status:

- the job is complete (its workers wrote `completed` as they left it): once every
  node of its last epoch has left or stopped, the group goes to zero nodes and the
  job's etcd instances stop. Every node does this, and doing it twice changes
  nothing.
- the agent exited for good (status 1: a crash, no GPU, etcd gone, a start
  that timed out): this instance leaves the group, and the group's size drops by
  one, since a replacement would most likely fail alike.
- the agent was fenced (its node declared dead, twice over; a worker killed by
  SIGKILL, the out-of-memory killer's among them, reads the same): this instance
  is terminated and the group replaces it with a fresh machine.
- released by the surplus rule (status RELEASED, 77: in no pipeline, beyond the
  standby; agents/release.py): it leaves the group, one smaller, as above.
- anything else (drained by a notice or SIGTERM): nothing. The cloud is taking the
  instance back.

    python -m cloud.node_exit ec2 --status N --etcd HOST:PORT[,...] --job NAME --region R
                              --group NAME --instance ID [--etcd-instance ID ...]
    python -m cloud.node_exit gcp ... --project P --instance ZONE/NAME [--etcd-instance ZONE/NAME ...]

Errors are printed as one line. The exit status is always 0, because the node's
end should not wait on this.
"""
from __future__ import annotations

import argparse
import sys
from enum import Enum

from bamboo.control.exits import FENCED


class Action(str, Enum):
    FINISH = "finish"      # group to zero, etcd stopped
    LEAVE = "leave"        # terminate this instance, the group one smaller
    REPLACE = "replace"    # terminate this instance, the group replaces it
    NOTHING = "nothing"


def decide(status: int, completed: bool) -> Action:
    """The action for an agent's exit `status`, given whether the job is complete."""
    if completed:
        return Action.FINISH
    if status == FENCED:
        return Action.REPLACE
    return Action.LEAVE if status != 0 else Action.NOTHING


def job_completed(etcd: str, job: str, patience: float = 600.0) -> bool:
    """Whether the job is complete: a worker left it finished (`completed`), and then,
    once every member of its last epoch left it too or stopped (its worker's lease
    gone), so that no final checkpoint write is cut short; False when etcd does not
    answer, or the others are still at it after `patience` seconds: then nothing is
    torn down on a guess."""
    from bamboo.control.cluster import Cluster
    from bamboo.control.protocol import COMPLETED
    try:
        cluster = Cluster(etcd, job, read_only=True)
        try:
            if not cluster.children(COMPLETED()):
                return False
            members = set(cluster.latest_assignment().members)
            return cluster.wait_for(lambda: not ((members - set(cluster.children(COMPLETED()))) & cluster.alive()),
                                    timeout=patience, what="the job's other nodes to leave", poll=1.0)
        finally:
            cluster.close()
    except Exception as e:  # noqa: BLE001 -- any etcd failure: one line, no teardown
        print(f"cloud.node_exit: etcd at {etcd} did not say whether the job is complete: "
              f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}", file=sys.stderr)
        return False


def node_client(service: str, region: str, endpoint_url: str | None):
    """A boto3 client as the instance's role, with short time-outs: a node's end
    (or its group's growth) should not wait on a slow API."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 3})
    return boto3.client(service, region_name=region, endpoint_url=endpoint_url, config=config)


def act_ec2(action: Action, args) -> None:
    """`action` through the EC2 and Auto Scaling APIs, as the instance's role."""
    scaling = node_client("autoscaling", args.region, args.endpoint_url)
    if action is Action.FINISH:  # etcd first: scaling in takes this very instance too
        if args.etcd_instance:
            node_client("ec2", args.region, args.endpoint_url).stop_instances(InstanceIds=list(args.etcd_instance))
        scaling.update_auto_scaling_group(AutoScalingGroupName=args.group, MinSize=0, DesiredCapacity=0)
    elif action in (Action.LEAVE, Action.REPLACE):
        scaling.terminate_instance_in_auto_scaling_group(
            InstanceId=args.instance, ShouldDecrementDesiredCapacity=action is Action.LEAVE)


def act_gcp(action: Action, args) -> None:
    """`action` through Compute Engine, as the instance's service account (a regional
    group: deleteInstances lowers its target size, a deleted instance is recreated)."""
    from cloud.gcp import GcpProvider
    provider = GcpProvider(args.project, args.region, args.endpoint_url)
    zone, _, name = args.instance.partition("/")
    if action is Action.FINISH:  # etcd first: scaling in takes this very instance too
        for etcd in args.etcd_instance:
            provider.stop_instance(*etcd.split("/", 1))
        provider.scale(args.group, 0)
    elif action is Action.LEAVE:
        provider.leave_group(args.group, zone, name)
    elif action is Action.REPLACE:
        provider.remove_instance(zone, name)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cloud.node_exit", description=__doc__.splitlines()[0])
    ap.add_argument("cloud", choices=("ec2", "gcp"))
    ap.add_argument("--status", type=int, required=True, help="the agent's exit status")
    ap.add_argument("--etcd", required=True, help="the job's etcd, HOST:PORT[,...]")
    ap.add_argument("--job", required=True, help="the job's name")
    ap.add_argument("--region", required=True, help="the group's region")
    ap.add_argument("--group", required=True, help="the job's Auto Scaling group")
    ap.add_argument("--instance", required=True, help="this instance: its id (EC2), ZONE/NAME (GCP)")
    ap.add_argument("--project", help="gcp: the project")
    ap.add_argument("--etcd-instance", action="append", default=[], metavar="ID|ZONE/NAME",
                    help="repeatable: the job's etcd instances, stopped when the job is complete")
    ap.add_argument("--patience", type=float, default=600.0, metavar="SECONDS",
                    help="how long a complete job's other nodes may take to leave it before nothing is done")
    ap.add_argument("--endpoint-url", help="the API endpoint (tests point it at a local server)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    action = decide(args.status, job_completed(args.etcd, args.job, args.patience))
    print(f"cloud.node_exit: the agent exited with status {args.status}: {action.value}", flush=True)
    try:
        (act_ec2 if args.cloud == "ec2" else act_gcp)(action, args)
    except Exception as e:  # noqa: BLE001 -- boto3's errors: one line
        print(f"cloud.node_exit: {action.value} failed: {str(e).splitlines()[0][:300]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
