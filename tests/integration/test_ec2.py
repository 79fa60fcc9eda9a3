"""EC2 spot capacity with the real boto3 client against a moto server on loopback:
template and autoscaling group over three zones, scale, a preemption (an instance
terminated), tear-down; bad zones, refusals with roll-back, missing credentials,
and the dry run. (moto places every instance in one zone: the tests check the
zones the requests ask for.)"""
import base64
import json
import os
import subprocess
import sys

import boto3
import pytest

from cloud.common import Install, LaunchError
from cloud.ec2 import Ec2Provider, Ec2Spec

REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c")


@pytest.fixture
def aws(moto_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_endpoint)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return moto_endpoint, ec2, image


def spec(image, name, **kw):
    return Ec2Spec(name=name, region=REGION, zones=kw.pop("zones", ZONES), nodes=kw.pop("nodes", 3), image=image,
                   etcd="10.0.0.5:2379", job="gpt", install=Install("https://example.com/b.whl"), **kw)


def test_group_over_three_zones_scale_preempt_and_tear_down(aws):
    endpoint, ec2, image = aws
    provider = Ec2Provider(REGION, endpoint)
    made = provider.up(spec(image, "bamboo-up", key_name="k", iam_profile="p"), provider.subnets(ZONES))
    subnets = ec2.describe_subnets(SubnetIds=made["subnets"])["Subnets"]
    assert sorted(s["AvailabilityZone"] for s in subnets) == sorted(ZONES)
    asg = boto3.client("autoscaling", region_name=REGION, endpoint_url=endpoint)
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["bamboo-up"])["AutoScalingGroups"][0]
    assert sorted(group["VPCZoneIdentifier"].split(",")) == sorted(made["subnets"])
    assert group["DesiredCapacity"] == 3
    version = ec2.describe_launch_template_versions(LaunchTemplateName="bamboo-up")["LaunchTemplateVersions"][0]
    data = version["LaunchTemplateData"]
    assert data["IamInstanceProfile"]["Name"] == "p" and data["MetadataOptions"]["HttpTokens"] == "required"
    spot = group["MixedInstancesPolicy"]["InstancesDistribution"]
    assert spot["OnDemandPercentageAboveBaseCapacity"] == 0 and spot["SpotAllocationStrategy"] == "capacity-optimized"
    script = base64.b64decode(data["UserData"]).decode()
    assert "bamboo-agent\" --etcd 10.0.0.5:2379 --job gpt" in script and "--notice ec2" in script
    assert len(provider.describe("bamboo-up")) == 3

    provider.scale("bamboo-up", 5)
    instances = provider.describe("bamboo-up")
    assert len(instances) == 5 and all(i["lifecycle"] == "InService" for i in instances)
    ec2.terminate_instances(InstanceIds=[instances[0]["id"]])  # a preemption: the group replaces the node
    after = provider.describe("bamboo-up")
    assert instances[0]["id"] not in {i["id"] for i in after} and len(after) == 5

    provider.down("bamboo-up")
    assert not asg.describe_auto_scaling_groups(AutoScalingGroupNames=["bamboo-up"])["AutoScalingGroups"]
    templates = ec2.describe_launch_templates()["LaunchTemplates"]
    assert "bamboo-up" not in {t["LaunchTemplateName"] for t in templates}


def test_an_unknown_zone_is_refused_before_anything_is_created(aws):
    endpoint, ec2, image = aws
    with pytest.raises(LaunchError, match="unknown zone.*us-east-1q"):
        Ec2Provider(REGION, endpoint).subnets(("us-east-1a", "us-east-1q"))
    assert "bamboo-zone" not in {t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]}


def test_a_refused_group_rolls_the_template_back(aws):
    """A quota error on the group (injected at the client, the way botocore lets a
    handler answer a call) deletes the template the launch had created."""
    endpoint, ec2, image = aws
    provider = Ec2Provider(REGION, endpoint)

    class Refused:
        status_code = 400

    def quota(**kwargs):
        return Refused(), {"Error": {"Code": "LimitExceeded", "Message": "You have reached the limit of groups"},
                           "ResponseMetadata": {"HTTPStatusCode": 400}}
    provider.autoscaling.meta.events.register("before-call.auto-scaling.CreateAutoScalingGroup", quota)
    with pytest.raises(LaunchError, match="LimitExceeded"):
        provider.up(spec(image, "bamboo-quota"), provider.subnets(ZONES))
    assert "bamboo-quota" not in {t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]}


def launch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cloud.launch", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_dry_run_prints_every_request_and_sends_none(aws, tmp_path):
    endpoint, ec2, image = aws
    out = launch("ec2", "--dry-run", "--nodes", "4", "--zones", ",".join(ZONES), "--region", REGION,
                 "--image", image, "--etcd", "10.0.0.5:2379", "--job", "dry", "--name", "bamboo-dry",
                 "--package", "https://example.com/bamboo_spot-0.1.0-py3-none-any.whl",
                 "--state", str(tmp_path / "state.json"))
    assert out.returncode == 0, out.stderr
    requests = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["operation"] for r in requests] == ["describe_availability_zones", "describe_subnets",
                                                  "describe_instance_type_offerings", "create_security_group",
                                                  "authorize_security_group_ingress", "put_if_not_exists",
                                                  "create_launch_template", "create_auto_scaling_group"]
    assert requests[7]["params"]["DesiredCapacity"] == 4
    assert "bamboo-dry" not in {t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]}
    assert not (tmp_path / "state.json").exists()


def test_missing_credentials_is_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"}
    out = launch("ec2", "--nodes", "2", "--zones", "us-east-1a", "--region", REGION, "--image", "ami-1",
                 "--etcd", "auto", "--job", "j", "--package", "https://example.com/b.whl", "--iam-profile", "p",
                 "--state", str(tmp_path / "s.json"), env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "no AWS credentials" in lines[0], out.stderr


def test_fp16_on_a_type_without_a_known_gpu_is_refused_before_any_request(tmp_path):
    """Checked against the nodes' types, not this machine (which has no CUDA): a
    request would fail on the missing credentials with another message."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true"}
    common = ["ec2", "--nodes", "2", "--zones", "us-east-1a", "--region", REGION, "--image", "ami-1", "--etcd", "auto",
              "--job", "j", "--package", "https://example.com/b.whl", "--iam-profile", "p", "--precision", "fp16",
              "--state", str(tmp_path / "s.json")]
    out = launch(*common, "--instance-type", "g5.xlarge", "--instance-type", "c5.large", env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "--precision fp16 needs a GPU on each node: --instance-type c5.large is not a GPU type" in lines[0]
    out = launch(*common, "--instance-type", "g5.xlarge", env=env)  # passes the check: stops at the credentials
    assert out.returncode == 1 and "no AWS credentials" in out.stderr, out.stderr


@pytest.mark.slow
def test_etcd_auto_with_three_members_puts_one_in_each_zone(aws, tmp_path):
    """--etcd auto --etcd-members 3: three on-demand etcd instances, one per zone,
    each later one told the members before it; the nodes' agents get all three.
    Each member's certificate, for the address the cloud gave it, waits in the
    job's own bucket (made for them: --package ships no wheel), as does the nodes'."""
    endpoint, ec2, image = aws
    boto3.client("iam", region_name=REGION, endpoint_url=endpoint).create_instance_profile(
        InstanceProfileName="bamboo-node")
    state = tmp_path / "state.json"
    out = launch("--state", str(state), "ec2", "--nodes", "3", "--zones", ",".join(ZONES), "--region", REGION,
                 "--image", image, "--etcd", "auto", "--etcd-members", "3", "--job", "trio", "--name", "bamboo-trio",
                 "--endpoint-url", endpoint, "--package", "https://example.com/bamboo_spot-0.1.0-py3-none-any.whl",
                 "--iam-profile", "bamboo-node")
    assert out.returncode == 0, out.stderr
    made = json.loads(state.read_text())["jobs"]["trio"]
    ids = made["etcd_instances"]
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    found = {i["InstanceId"]: i for r in reservations for i in r["Instances"]}
    assert [found[i]["Placement"]["AvailabilityZone"] for i in ids] == list(ZONES)
    assert all(found[i].get("InstanceLifecycle") != "spot" for i in ids)  # on-demand
    endpoints = [f"{found[i]['PrivateIpAddress']}:2379" for i in ids]
    assert made["etcd"] == ",".join(endpoints)
    scripts = [base64.b64decode(ec2.describe_instance_attribute(InstanceId=i, Attribute="userData")["UserData"]
                                ["Value"]).decode() for i in ids]
    assert [s.split("\nJOIN=")[1].split("\n")[0] for s in scripts] == ["''", endpoints[0], ",".join(endpoints[:2])]
    assert ["NAME=bamboo-" + z in s for z, s in zip(ZONES, scripts)] == [True] * 3
    template = ec2.describe_launch_template_versions(LaunchTemplateName="bamboo-trio")["LaunchTemplateVersions"][0]
    boot = base64.b64decode(template["LaunchTemplateData"]["UserData"]).decode()
    assert f"--etcd {made['etcd']} " in boot
    group = made["security_group"]  # the job's: its nodes and etcd instances reach each other, no one else
    rules = ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"][0]["IpPermissions"]
    assert [(r["IpProtocol"], [p["GroupId"] for p in r["UserIdGroupPairs"]], r.get("IpRanges"))
            for r in rules] == [("-1", [group], [])]
    assert template["LaunchTemplateData"]["SecurityGroupIds"] == [group]
    assert all([g["GroupId"] for g in found[i]["SecurityGroups"]] == [group] for i in ids)
    _certificates_shipped(made, scripts, boot, [e.split(":")[0] for e in endpoints], endpoint)
    assert launch("--state", str(state), "down").returncode == 0
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=endpoint)
    assert made["wheel_bucket_created"]  # for the certificates (--package ships no wheel); down removed it
    assert "bamboo-trio-us-east-1" not in {b["Name"] for b in s3.list_buckets()["Buckets"]}
    assert not os.path.exists(made["etcd_tls"])
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    states = {i["State"]["Name"] for r in reservations for i in r["Instances"]}
    assert states <= {"shutting-down", "terminated"}
    assert group not in {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}


def _certificates_shipped(made: dict, scripts: list[str], boot: str, hosts: list[str], endpoint: str) -> None:
    """Member i fetches folder etcd-i, whose certificate names the address the
    cloud gave it; the nodes fetch theirs; no secret is in any script."""
    from cryptography import x509
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=endpoint)
    folders = [s.split("\nCERTS=")[1].split("\n")[0] for s in scripts]
    assert [f.rsplit("/", 2)[-2] for f in folders] == ["etcd-0", "etcd-1", "etcd-2"]
    for folder, host in zip(folders, hosts):
        bucket, _, key = folder[len("s3://"):].partition("/")
        pem = s3.get_object(Bucket=bucket, Key=key + "server.pem")["Body"].read()
        names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert host in [str(ip) for ip in names.value.get_values_for_type(x509.IPAddress)]
    assert "-m cloud.etcd_tls fetch s3://" in boot and "--role node" in boot
    assert all("PRIVATE KEY" not in text for text in (*scripts, boot))
    assert sorted(os.listdir(made["etcd_tls"])) == ["ca.pem", "client-key.pem", "client.pem"]
    assert len(made["certificates"]) == 3 * 4 + 3
    assert not [u for u in made["certificates"] if "root" in u]  # root's certificate is made for no one


@pytest.mark.parametrize("extra,message", [
    (["--zones", "us-east-1a,us-east-1b", "--etcd", "auto", "--etcd-members", "3"], "--zones names only 2"),
    (["--zones", ",".join(ZONES), "--etcd", "10.0.0.5:2379", "--etcd-members", "3"], "it needs --etcd auto"),
    (["--zones", ",".join(ZONES), "--etcd", "auto", "--etcd-members", "2"], "--etcd-members must be 1, 3, 5 or 7"),
    (["--zones", ",".join(ZONES), "--etcd", "auto"], "give --iam-profile"),
])
def test_bad_etcd_member_counts_are_one_line(extra, message, tmp_path, capsys):
    """bamboo-launch's own main, in this process: refused before any request."""
    from cloud import launch as command
    code = command.main(["--state", str(tmp_path / "s.json"), "ec2", "--nodes", "2", "--region", REGION, "--image",
                         "ami-1", "--job", "j", "--package", "https://example.com/b.whl", *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_four_gpu_type_boots_four_workers(aws):
    """The boot script runs one worker per GPU (bamboo-agent --workers N): four on
    p3.8xlarge; with types of different counts, the one IMDS names."""
    endpoint, ec2, image = aws
    provider = Ec2Provider(REGION, endpoint)
    provider.up(spec(image, "bamboo-4gpu", instance_types=("p3.8xlarge",)), provider.subnets(ZONES))
    version = ec2.describe_launch_template_versions(LaunchTemplateName="bamboo-4gpu")["LaunchTemplateVersions"][0]
    script = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
    assert "WORKERS=4; GPUS=4\n" in script and '--workers "$WORKERS"' in script
    assert '--expect-gpus "${BAMBOO_EXPECT_GPUS:-$GPUS}"' in script  # the agent checks torch sees them
    mixed = spec(image, "m", instance_types=("g5.xlarge", "g5.12xlarge", "c5.large")).user_data()
    assert "g5.12xlarge) WORKERS=4; GPUS=4;;" in mixed and "g5.xlarge) WORKERS=1; GPUS=1;;" in mixed
    assert "c5.large) WORKERS=1; GPUS=0;;" in mixed and "instance-type" in mixed
    provider.down("bamboo-4gpu")
