"""End to end, offline: `bamboo-launch ec2` configures a job in a real etcd and
uploads the project's wheel to S3 (moto); the user data it wrote into the launch
template then runs for real under bash in a local sandbox (tests/sandbox.py): the
zone and instance id from a fake IMDSv2, the wheel fetched through the presigned
URL (or, with --iam-profile, read from S3 with the role's credentials from the
fake IMDS) and pip-installed from local files only, and the node's agent joins the job
and trains. Losses equal the single-process reference (float64)."""
import base64
import glob
import json
import os
import subprocess
import sys
import time

import boto3
import pytest

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import DONE, LOSS, NOTICES, ZONES
from tests.sandbox import FakeMetadata, boot, boot_log
from tests.training import bamboo_train

REGION = "us-east-1"
BIN = os.path.dirname(sys.executable)
TRAIN = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--seed", "5", "--dtype", "float64"]


@pytest.fixture
def aws(moto_endpoint, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(k, v)
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_endpoint)
    boto3.client("s3", region_name=REGION, endpoint_url=moto_endpoint).create_bucket(Bucket="boot-wheels")
    return moto_endpoint, ec2, ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def launch_ec2(aws, etcd, tmp_path, job: str, nodes: int, iterations: int, *extra: str) -> str:
    """bamboo-launch as a user runs it; the user data of the template it made."""
    endpoint, ec2, image = aws
    out = subprocess.run([os.path.join(BIN, "bamboo-launch"), "--state", str(tmp_path / "state.json"), "ec2",
                          "--nodes", str(nodes), "--zones", "us-east-1a,us-east-1b,us-east-1c", "--region", REGION,
                          "--image", image, "--etcd", etcd.endpoint, "--job", job, "--name", job,
                          "--bucket", "boot-wheels", "--endpoint-url", endpoint, *TRAIN,
                          "--iterations", str(iterations), *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version = ec2.describe_launch_template_versions(LaunchTemplateName=job)["LaunchTemplateVersions"][0]
    return base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()


def wait_done(cluster: Cluster, iteration: int, procs: dict, timeout: float = 300) -> None:
    """Until some node reported `iteration` (an etcd watch wakes us); a boot or
    agent that exits early fails the test with its log."""
    changed = cluster.changes(DONE())
    deadline = time.monotonic() + timeout
    while not cluster.children(DONE(iteration)):
        for name, (proc, log) in procs.items():
            if proc.poll() not in (None, 0):
                pytest.fail(f"{name} exited with {proc.returncode}:\n{log()[-3000:]}")
        assert time.monotonic() < deadline, f"iteration {iteration} not done in {timeout} s"
        changed.wait(1.0)
        changed.take()


def losses(cluster: Cluster, iterations: int, microbatches: int = 4) -> list[float]:
    out = []
    for it in range(iterations):
        found = cluster.children(LOSS(it))
        assert sorted(found) == list(range(microbatches)), f"iteration {it}"
        out.append(sum(v.value for v in found.values()) / microbatches)
    return out


def reference(tmp_path, iterations: int) -> list[float]:
    _, records = bamboo_train(tmp_path / "ref.jsonl", *TRAIN, "--stages", "1", "--iterations", str(iterations))
    return [r["loss"] for r in records]


def installed_from_wheel(root) -> bool:
    """The node's venv holds the project as pip installed it from the fetched wheel."""
    found = glob.glob(os.path.join(root, "opt", "bamboo", "lib", "python3.*", "site-packages",
                                   "bamboo_spot-*.dist-info", "direct_url.json"))
    return bool(found) and json.load(open(found[0]))["url"].startswith(f"file://{root}/opt/bamboo_spot-")


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_a_node_boots_from_the_ec2_user_data_and_trains(aws, etcd, tmp_path):
    """One node from the script, its peer a plain agent (P=2): the booted node
    finds its zone, installs the launched code and trains with the peer."""
    iterations = 4
    script = launch_ec2(aws, etcd, tmp_path, "boot-one", nodes=2, iterations=iterations)
    meta = FakeMetadata("us-east-1a", "i-0b00t")
    root = tmp_path / "node-a"
    (tmp_path / "wheelhouse").mkdir()
    node = boot(script, root, meta, tmp_path / "wheelhouse")
    peer = subprocess.Popen([os.path.join(BIN, "bamboo-agent"), "--etcd", etcd.endpoint, "--job", "boot-one",
                             "--zone", "us-east-1b"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = Cluster(etcd.endpoint, "boot-one")
    try:
        wait_done(cluster, iterations - 1, {"the booted node": (node, lambda: boot_log(root)),
                                            "the peer agent": (peer, lambda: "")})
        assert node.wait(60) == 0, boot_log(root)[-3000:]
        assert peer.wait(60) == 0
        zones = {z.zone for z in cluster.children(ZONES()).values()}
        assert zones == {"us-east-1a", "us-east-1b"}
        assert "PUT /latest/api/token" in meta.requests and "instance i-0b00t in zone us-east-1a" in boot_log(root)
        assert installed_from_wheel(str(root))
        assert losses(cluster, iterations) == pytest.approx(reference(tmp_path, iterations), rel=1e-9)
        # the job is complete: the node's end (cloud/node_exit.py) took its group to zero
        assert "status 0: finish" in boot_log(root)
        scaling = boto3.client("autoscaling", region_name=REGION, endpoint_url=aws[0])
        assert scaling.describe_auto_scaling_groups(AutoScalingGroupNames=["boot-one"])[
            "AutoScalingGroups"][0]["DesiredCapacity"] == 0, boot_log(root)[-1500:]
    finally:
        for p in (node, peer):
            if p.poll() is None:
                os.killpg(p.pid, 9) if p is node else p.kill()
        cluster.close()
        meta.close()


@pytest.mark.slow
def test_three_nodes_boot_train_and_one_drains_on_a_spot_notice(aws, etcd, tmp_path):
    """Three nodes from the script (P=2: a pipeline and a standby, kept: --surplus
    keep, as the priced rule keeps none before any preemption). After iteration 2
    the IMDS of a node in the pipeline posts spot/instance-action: its agent drains
    it, the standby takes the stage, and the losses are the reference's."""
    iterations = 10
    # with a role, the nodes read the wheel from S3 with it (boto3, the fake IMDS's credentials), no URL
    script = launch_ec2(aws, etcd, tmp_path, "boot-three", 3, iterations, "--max-stages-per-node", "1",
                        "--surplus", "keep", "--iam-profile", "bamboo-node")
    assert "download_file" in script and "curl -fsS --retry 5 -o" not in script
    (tmp_path / "wheelhouse").mkdir()
    metas = {z: FakeMetadata(z, f"i-0{z[-1]}") for z in ("us-east-1a", "us-east-1b", "us-east-1c")}
    roots = {z: tmp_path / f"node-{z[-1]}" for z in metas}
    nodes = {z: boot(script, roots[z], metas[z], tmp_path / "wheelhouse") for z in metas}
    procs = {f"node in {z}": (nodes[z], lambda z=z: boot_log(roots[z])) for z in metas}
    cluster = Cluster(etcd.endpoint, "boot-three")
    try:
        wait_done(cluster, 2, procs)
        zone_of = {n: z.zone for n, z in cluster.children(ZONES()).items()}
        assert sorted(zone_of.values()) == sorted(metas)
        working = cluster.latest_assignment().pipelines[0]
        victim = zone_of[working[0]]
        metas[victim].notice()
        wait_done(cluster, iterations - 1, procs)
        for z, proc in nodes.items():
            assert proc.wait(60) == 0, boot_log(roots[z])[-3000:]
        assert working[0] in cluster.children(NOTICES())
        assert working[0] not in cluster.latest_assignment().members
        assert all(installed_from_wheel(str(r)) for r in roots.values())
        assert losses(cluster, iterations) == pytest.approx(reference(tmp_path, iterations), rel=1e-9)
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        cluster.close()
        for m in metas.values():
            m.close()
