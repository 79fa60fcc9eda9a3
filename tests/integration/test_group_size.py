"""A release lowers the job's group and a grow raises it, run as a node runs them
(real processes): cloud.node_exit with the agent's RELEASED status takes the
instance out, one smaller (EC2 TerminateInstanceInAutoScalingGroup with
ShouldDecrementDesiredCapacity; GCP deleteInstances), and cloud.group_size sets
the desired capacity (SetDesiredCapacity) or target size (resize) up, never down,
against a moto server and the fake Compute Engine."""
import subprocess
import sys

import pytest

from bamboo.control.exits import RELEASED
from tests.integration.test_node_exit import REGION, gcp_exit, gcp_group, group, node_exit, state  # noqa: F401


def group_size(*args):
    out = subprocess.run([sys.executable, "-m", "cloud.group_size", *args], capture_output=True, text=True,
                         timeout=120)
    return out


def test_ec2_release_lowers_and_grow_raises_the_desired_capacity(moto_endpoint, etcd, group):
    name, provider, ec2, etcd_instance = group
    desired, instances, _ = state(provider, ec2, name, etcd_instance)
    assert desired == 3
    released = sorted(instances)[0]
    out = node_exit(moto_endpoint, etcd.endpoint, "release-job", name, released, etcd_instance, RELEASED)
    assert "leave" in out.stdout
    desired, instances, _ = state(provider, ec2, name, etcd_instance)
    assert desired == 2 and released not in instances
    grow = ["ec2", "--region", REGION, "--group", name, "--endpoint-url", moto_endpoint]
    out = group_size(*grow, "--desired", "5", "--job", "ignored", "--etcd", "ignored")  # node_exit's too
    assert out.returncode == 0, out.stderr
    assert state(provider, ec2, name, etcd_instance)[0] == 5
    assert group_size(*grow, "--desired", "4").returncode == 0
    assert state(provider, ec2, name, etcd_instance)[0] == 5  # it only grows: a release lowers it
    out = group_size(*grow, "--desired", "0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--desired must be at least 1" in out.stderr


@pytest.mark.slow  # make test-slow: EC2's group (above) runs the same release and grow in make test
def test_gcp_release_lowers_and_grow_raises_the_target_size(etcd, gcp_group):
    compute = gcp_group
    gcp_exit(compute, etcd.endpoint, "release-job", RELEASED)
    assert compute.groups["gcp-group"]["targetSize"] == 2
    grow = ["gcp", "--project", "proj", "--region", "us-central1", "--group", "gcp-group",
            "--endpoint-url", compute.url]
    out = group_size(*grow, "--desired", "4")
    assert out.returncode == 0, out.stderr
    assert compute.groups["gcp-group"]["targetSize"] == 4
    assert group_size(*grow, "--desired", "3").returncode == 0
    assert compute.groups["gcp-group"]["targetSize"] == 4  # from the target size: never lowered


def test_an_unknown_group_is_one_line(moto_endpoint, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        monkeypatch.setenv(k, v)
    out = group_size("ec2", "--region", REGION, "--group", "no-such-group", "--endpoint-url", moto_endpoint,
                     "--desired", "3")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no autoscaling group" in out.stderr
