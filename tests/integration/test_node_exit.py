"""A cloud node's end, run as the boot script runs it (`python -m cloud.node_exit`,
a real process) against a moto server (EC2) or the fake Compute Engine (GCP) and a
real etcd: a complete job scales its
group to zero and stops its etcd instances; an agent that exited for good takes
its instance out of the group, one smaller; a fenced one is replaced; a drained
one changes nothing, and so does an etcd that does not answer."""
import os
import subprocess
import sys

import boto3
import pytest

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.exits import FENCED
from bamboo.control.protocol import ALIVE, ASSIGNMENT, COMPLETED, Alive, Timestamp
from cloud.common import Install
from cloud.ec2 import Ec2Provider, Ec2Spec

REGION = "us-east-1"


@pytest.fixture
def group(moto_endpoint, monkeypatch, request):
    """A job's group of three nodes and an etcd instance, in moto."""
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        monkeypatch.setenv(k, v)
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_endpoint)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    name = f"exit-{request.node.name[-40:].replace('[', '-').replace(']', '')}"
    provider = Ec2Provider(REGION, moto_endpoint)
    provider.up(Ec2Spec(name=name, region=REGION, zones=("us-east-1a",), nodes=3, image=image, etcd="10.0.0.5:2379",
                        job="gpt", install=Install("https://example.com/b.whl")), provider.subnets(("us-east-1a",)))
    etcd_instance = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    yield name, provider, ec2, etcd_instance
    provider.down(name)


def node_exit(moto_endpoint, etcd, job, name, instance, etcd_instance, status, patience=600):
    out = subprocess.run([sys.executable, "-m", "cloud.node_exit", "ec2", "--status", str(status), "--etcd", etcd,
                          "--job", job, "--region", REGION, "--group", name, "--instance", instance,
                          "--etcd-instance", etcd_instance, "--endpoint-url", moto_endpoint,
                          "--patience", str(patience)],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    return out


def state(provider, ec2, name, etcd_instance):
    scaling = provider.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    etcd_state = ec2.describe_instances(InstanceIds=[etcd_instance])["Reservations"][0]["Instances"][0]["State"]
    return scaling["DesiredCapacity"], {i["InstanceId"] for i in scaling["Instances"]}, etcd_state["Name"]


def finished_job(etcd, job: str, still_running: int | None = None) -> Cluster:
    """A job of nodes 0, 1 and 2 whose node 0 left it finished, node 1 died, and
    `still_running` (if given) is still writing its last checkpoint."""
    cluster = Cluster(etcd.endpoint, job)
    cluster.create(ASSIGNMENT(0), Assignment(0, 0, ((0, 1, 2),)))
    cluster.create(COMPLETED(0), Timestamp(1.0))
    if still_running is not None:
        cluster.put(ALIVE(still_running), Alive(still_running))
    else:
        cluster.create(COMPLETED(2), Timestamp(2.0))
    return cluster


def test_a_complete_job_scales_its_group_to_zero_and_stops_its_etcd(moto_endpoint, etcd, group):
    name, provider, ec2, etcd_instance = group
    finished_job(etcd, "done-job").close()
    instance = sorted(state(provider, ec2, name, etcd_instance)[1])[0]
    out = node_exit(moto_endpoint, etcd.endpoint, "done-job", name, instance, etcd_instance, 0)
    assert "finish" in out.stdout
    desired, members, etcd_state = state(provider, ec2, name, etcd_instance)
    assert desired == 0 and etcd_state in ("stopping", "stopped")


def test_a_node_still_leaving_the_complete_job_is_waited_for(moto_endpoint, etcd, group):
    """Node 2 still runs (its final checkpoint, say): nothing is torn down under it."""
    name, provider, ec2, etcd_instance = group
    finished_job(etcd, "leaving-job", still_running=2).close()
    before = state(provider, ec2, name, etcd_instance)
    out = node_exit(moto_endpoint, etcd.endpoint, "leaving-job", name, sorted(before[1])[0], etcd_instance, 0,
                    patience=2)
    assert "waiting for the job's other nodes to leave" in out.stderr and "nothing" in out.stdout
    assert state(provider, ec2, name, etcd_instance) == before


@pytest.mark.parametrize("status,desired,replaced", [(1, 2, False), (FENCED, 3, True)])
def test_an_agent_gone_for_good_leaves_the_group_and_a_fenced_one_is_replaced(moto_endpoint, etcd, group, status,
                                                                              desired, replaced):
    name, provider, ec2, etcd_instance = group
    before = state(provider, ec2, name, etcd_instance)[1]
    instance = sorted(before)[0]
    node_exit(moto_endpoint, etcd.endpoint, "running-job", name, instance, etcd_instance, status)
    now, members, etcd_state = state(provider, ec2, name, etcd_instance)
    assert now == desired and instance not in members and etcd_state == "running"


@pytest.mark.parametrize("etcd_answers", [True, False])
def test_a_drained_agent_changes_nothing(moto_endpoint, etcd, group, etcd_answers):
    name, provider, ec2, etcd_instance = group
    before = state(provider, ec2, name, etcd_instance)
    endpoint = etcd.endpoint if etcd_answers else "127.0.0.1:9"
    out = node_exit(moto_endpoint, endpoint, "running-job", name, sorted(before[1])[0], etcd_instance, 0)
    assert "nothing" in out.stdout and state(provider, ec2, name, etcd_instance) == before


@pytest.fixture
def gcp_group():
    """A GCP job's regional group of three nodes and its etcd instance, in the fake Compute Engine."""
    from cloud.gcp import GcpProvider, GcpSpec
    from tests.fake_gcp import FakeCompute
    compute = FakeCompute()
    provider = GcpProvider("proj", "us-central1", compute.url)
    provider.up(GcpSpec(name="gcp-group", project="proj", region="us-central1", zones=compute.zones, nodes=3,
                        image="img", etcd="10.0.0.5:2379", job="gpt", install=Install("https://example.com/b.whl")))
    provider.etcd_node(GcpSpec(name="gcp-group", project="proj", region="us-central1", zones=compute.zones, nodes=3,
                               image="img", etcd="", job="gpt", install=Install("x")), compute.zones[0], "#!/bin/bash")
    yield compute
    compute.shutdown()


def gcp_exit(compute, etcd, job, status):
    node = f"{compute.zones[1]}/gcp-group-0001"
    out = subprocess.run([sys.executable, "-m", "cloud.node_exit", "gcp", "--status", str(status), "--etcd", etcd,
                          "--job", job, "--region", "us-central1", "--group", "gcp-group", "--project", "proj",
                          "--instance", node, "--etcd-instance", f"{compute.zones[0]}/gcp-group-etcd",
                          "--endpoint-url", compute.url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr
    return node


@pytest.mark.parametrize("status,complete", [(0, True), (1, False), (FENCED, False), (0, False)])
def test_the_same_ends_on_gcp(etcd, gcp_group, status, complete):
    """complete: the group to 0, etcd stopped; 1: deleteInstances (one smaller); fenced: the
    instance deleted, the group recreates it; drained: nothing."""
    compute, job = gcp_group, f"gcp-{status}-{complete}"
    if complete:
        finished_job(etcd, job).close()
    node = gcp_exit(compute, etcd.endpoint, job, status)
    size, etcd_status = compute.groups["gcp-group"]["targetSize"], compute.instances["gcp-group-etcd"].get("status")
    zone, name = node.split("/")
    deleted = ("DELETE", f"/compute/v1/projects/proj/zones/{zone}/instances/{name}")
    assert (size, etcd_status, compute.left, deleted in compute.requests) == {
        (0, True): (0, "TERMINATED", [], False),
        (1, False): (2, None, [f"zones/{zone}/instances/{name}"], False),
        (FENCED, False): (3, None, [], True),
        (0, False): (3, None, [], False)}[(status, complete)]
