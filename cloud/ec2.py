"""EC2 spot capacity for a job, with boto3: a launch template and an autoscaling
group with a mixed-instances policy (several instance types, GPU ones by default,
all spot, capacity-optimized allocation) over one subnet in each chosen zone.
Every instance boots into `bamboo-agent` (user data) with the job's etcd
endpoint, its own zone (IMDSv2) and spot-notice watching.

Each API request goes through `_call`, which with `dry_run` prints the request
instead of sending it. Credentials come from boto3's standard chain and are never
printed. A failure half-way through `up` deletes what `up` created.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

from cloud.common import Install, LaunchError, NodeLines, boot_script, node_exit_args

# Spot GPU types with one GPU each, cheapest first: the allocation strategy picks
# among them by spare capacity, so more types mean fewer interruptions.
GPU_TYPES = ("g4dn.xlarge", "g5.xlarge", "g6.xlarge", "g4dn.2xlarge", "g5.2xlarge")
# GPUs of the instance types bamboo-launch knows: the node runs that many workers
# (bamboo-agent --workers N); a type not listed runs one.
GPUS = {"g4dn.xlarge": 1, "g4dn.2xlarge": 1, "g4dn.4xlarge": 1, "g4dn.8xlarge": 1, "g4dn.12xlarge": 4,
        "g4dn.16xlarge": 1, "g4dn.metal": 8, "g5.xlarge": 1, "g5.2xlarge": 1, "g5.4xlarge": 1, "g5.8xlarge": 1,
        "g5.12xlarge": 4, "g5.16xlarge": 1, "g5.24xlarge": 4, "g5.48xlarge": 8, "g6.xlarge": 1, "g6.2xlarge": 1,
        "g6.12xlarge": 4, "g6.48xlarge": 8, "p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8,
        "p4d.24xlarge": 8, "p5.48xlarge": 8}
METADATA = "http://169.254.169.254"
ZONE_LOOKUP = """TOKEN=$(curl -fsSX PUT "$META/latest/api/token" -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
ZONE=$(curl -fsS -H "X-aws-ec2-metadata-token: $TOKEN" "$META/latest/meta-data/placement/availability-zone")
INSTANCE=$(curl -fsS -H "X-aws-ec2-metadata-token: $TOKEN" "$META/latest/meta-data/instance-id")
NODE_REF=$INSTANCE"""


@dataclass(frozen=True)
class Ec2Spec:
    name: str
    region: str
    zones: tuple[str, ...]
    nodes: int
    image: str
    etcd: str
    job: str
    install: Install
    instance_types: tuple[str, ...] = GPU_TYPES
    key_name: str | None = None
    security_groups: tuple[str, ...] = ()
    iam_profile: str | None = None
    tags: dict = field(default_factory=dict)
    certs: str = ""     # the nodes' folder of etcd certificates (cloud/etcd_tls.py); none: a plain etcd
    etcd_instances: tuple[str, ...] = ()  # --etcd auto's instances, stopped once the job is complete
    endpoint_url: str | None = None       # the API endpoint the nodes call too (tests: a local server)

    def user_data(self) -> str:
        return boot_script(self.install, self.etcd, self.job, NodeLines(
            "ec2", METADATA, ZONE_LOOKUP, workers_lookup(self.instance_types), self.certs, node_exit_args("ec2", self)))


def workers_lookup(types: tuple[str, ...]) -> str:
    """Shell lines that set WORKERS to the GPUs of the instance (GPUS), and GPUS to
    those its agent checks torch sees (0 for a type the table does not know): one
    pair when every type has as many, else the instance's type asked of IMDS."""
    counts = {t: GPUS.get(t, 0) for t in types}
    if len(set(counts.values())) == 1:
        n = next(iter(counts.values()))
        return f"WORKERS={max(n, 1)}; GPUS={n}"
    cases = " ".join(f"{t}) WORKERS={max(n, 1)}; GPUS={n};;" for t, n in counts.items())
    return ('TYPE=$(curl -fsS -H "X-aws-ec2-metadata-token: $TOKEN" "$META/latest/meta-data/instance-type")\n'
            f'case "$TYPE" in {cases} *) WORKERS=1; GPUS=0;; esac')


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

    # -- checks, before anything is created ---------------------------------------------
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

    def check_types(self, types: tuple[str, ...], zones: tuple[str, ...]) -> None:
        """Every instance type is offered in at least one of the zones."""
        found = self._call("ec2", "describe_instance_type_offerings", LocationType="availability-zone",
                           Filters=[{"Name": "location", "Values": list(zones)},
                                    {"Name": "instance-type", "Values": list(types)}])
        offered = {o["InstanceType"] for o in found.get("InstanceTypeOfferings", [])}
        missing = [t for t in types if t not in offered and not self.dry_run]
        if missing:
            raise LaunchError(f"instance type(s) {', '.join(missing)} not offered in {', '.join(zones)} "
                              f"(region {self.region})")

    # -- the group ----------------------------------------------------------------------
    def up(self, spec: Ec2Spec, subnets: dict[str, str]) -> dict:
        """Template and group; on a failure, what was created is deleted again."""
        data = {"ImageId": spec.image, "UserData": base64.b64encode(spec.user_data().encode()).decode(),
                "TagSpecifications": [{"ResourceType": "instance", "Tags": _tags(spec)}],
                "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"}}
        if spec.key_name:
            data["KeyName"] = spec.key_name
        if spec.security_groups:
            data["SecurityGroupIds"] = list(spec.security_groups)
        if spec.iam_profile:
            data["IamInstanceProfile"] = {"Name": spec.iam_profile}
        self._call("ec2", "create_launch_template", LaunchTemplateName=spec.name, LaunchTemplateData=data)
        policy = {"LaunchTemplate": {"LaunchTemplateSpecification": {"LaunchTemplateName": spec.name,
                                                                     "Version": "$Latest"},
                                     "Overrides": [{"InstanceType": t} for t in spec.instance_types]},
                  "InstancesDistribution": {"OnDemandBaseCapacity": 0, "OnDemandPercentageAboveBaseCapacity": 0,
                                            "SpotAllocationStrategy": "capacity-optimized"}}
        try:
            self._call("autoscaling", "create_auto_scaling_group", AutoScalingGroupName=spec.name,
                       MixedInstancesPolicy=policy, MinSize=0, MaxSize=max(spec.nodes * 2, 1),
                       DesiredCapacity=spec.nodes, VPCZoneIdentifier=",".join(subnets[z] for z in spec.zones),
                       Tags=[dict(t, PropagateAtLaunch=True) for t in _tags(spec)])
        except LaunchError:
            self._call("ec2", "delete_launch_template", LaunchTemplateName=spec.name)
            raise
        return {"provider": "ec2", "name": spec.name, "region": self.region, "zones": list(spec.zones),
                "subnets": [subnets[z] for z in spec.zones], "nodes": spec.nodes,
                "instance_types": list(spec.instance_types)}

    def scale(self, name: str, nodes: int) -> None:
        self._call("autoscaling", "update_auto_scaling_group", AutoScalingGroupName=name,
                   MaxSize=max(nodes * 2, 1), DesiredCapacity=nodes)

    def describe(self, name: str) -> list[dict]:
        """The group's instances: id, zone, type, lifecycle and health."""
        groups = self._call("autoscaling", "describe_auto_scaling_groups",
                            AutoScalingGroupNames=[name])["AutoScalingGroups"]
        if not groups:
            raise LaunchError(f"no autoscaling group {name!r} in {self.region}")
        return [{"id": i["InstanceId"], "zone": i["AvailabilityZone"], "type": i.get("InstanceType"),
                 "lifecycle": i["LifecycleState"], "health": i.get("HealthStatus")}
                for i in groups[0].get("Instances", [])]

    def down(self, name: str) -> None:
        self._call("autoscaling", "delete_auto_scaling_group", AutoScalingGroupName=name, ForceDelete=True)
        self._call("ec2", "delete_launch_template", LaunchTemplateName=name)

    # -- the job's own security group ---------------------------------------------------
    def job_group(self, spec: Ec2Spec, subnets: dict[str, str]) -> str:
        """A security group admitting, on every port (etcd's, gloo's and NCCL's,
        which are ephemeral), only instances that carry it: the job's nodes and its
        etcd instances. Nothing else comes in (SSH needs a --security-group of the user's)."""
        vpcs = ["<the subnets' vpc>"] if self.dry_run else sorted(
            {s["VpcId"] for s in self._call("ec2", "describe_subnets", SubnetIds=list(subnets.values()))["Subnets"]})
        if len(vpcs) != 1:
            raise LaunchError(f"the subnets of {', '.join(spec.zones)} lie in {len(vpcs)} VPCs "
                              f"({', '.join(vpcs)}): a job's nodes must share one")
        group = self._call("ec2", "create_security_group", GroupName=f"bamboo-{spec.job}", VpcId=vpcs[0],
                           Description=f"bamboo job {spec.job}: its nodes and etcd reach each other, no one else",
                           TagSpecifications=[{"ResourceType": "security-group", "Tags": _tags(spec)}])
        group_id = group.get("GroupId", "<job security group>")
        self._call("ec2", "authorize_security_group_ingress", GroupId=group_id, IpPermissions=[
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id, "Description": "the job's own"}]}])
        return group_id

    def remove_group(self, group_id: str, patience: float = 300.0) -> None:
        """Delete the job's group once no instance holds it (terminating ones still do)."""
        deadline = time.monotonic() + patience
        while True:
            try:
                self._call("ec2", "delete_security_group", GroupId=group_id)
                return
            except LaunchError as e:
                if "DependencyViolation" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(5)

    # -- --etcd auto ----------------------------------------------------------------------
    def etcd_node(self, spec: Ec2Spec, zone: str, subnet: str, script: str) -> tuple[str, str]:
        """A small on-demand instance running etcd (and writing the job's config
        into it: `script`), in the job's security groups; its id and endpoint."""
        groups = {"SecurityGroupIds": list(spec.security_groups)} if spec.security_groups else {}
        if spec.iam_profile:  # it reads its certificates from the job's bucket with this role
            groups["IamInstanceProfile"] = {"Name": spec.iam_profile}
        if spec.key_name:  # bamboo-launch dashboard --via ssh can go through it
            groups["KeyName"] = spec.key_name
        reply = self._call("ec2", "run_instances", ImageId=spec.image, InstanceType="t3.small", MinCount=1,
                           MaxCount=1, SubnetId=subnet, UserData=script, **groups,  # boto3 base64-encodes it
                           TagSpecifications=[{"ResourceType": "instance",
                                               "Tags": _tags(spec) + [{"Key": "bamboo-role", "Value": "etcd"}]}])
        instance = reply["Instances"][0]
        return instance.get("InstanceId", "<etcd instance>"), \
            f"{instance.get('PrivateIpAddress', '<etcd private ip>')}:2379"

    def remove_instance(self, instance: str) -> None:
        self._call("ec2", "terminate_instances", InstanceIds=[instance])


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
