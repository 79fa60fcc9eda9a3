"""GCP spot capacity with the real google-cloud-compute client (REST, anonymous
credentials) against a fake Compute Engine endpoint on loopback."""
import json
import os
import subprocess
import sys

import pytest

from cloud.common import Install, LaunchError
from cloud.gcp import GcpProvider, GcpSpec
from cloud.records import read_records
from tests.fake_gcp import FakeCompute

ZONES = ("us-central1-a", "us-central1-b", "us-central1-c")


@pytest.fixture
def compute():
    server = FakeCompute(ZONES)
    yield server
    server.shutdown()


def spec(name="bamboo-gcp", zones=ZONES, nodes=3):
    return GcpSpec(name=name, project="proj", region="us-central1", zones=zones, nodes=nodes,
                   image="projects/debian-cloud/global/images/family/debian-12", etcd="10.0.0.5:2379", job="gpt",
                   install=Install("https://example.com/bamboo_spot-0.1.0-py3-none-any.whl"))


def test_spot_template_and_regional_group_over_three_zones(compute):
    provider = GcpProvider("proj", "us-central1", compute.url)
    provider.up(spec())
    template = compute.templates["bamboo-gcp"]["properties"]
    assert template["scheduling"]["provisioningModel"] == "SPOT"
    assert template["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert template["guestAccelerators"] == [{"acceleratorType": "nvidia-tesla-t4", "acceleratorCount": 1}]
    assert template["networkInterfaces"][0]["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"
    assert template["serviceAccounts"] == [{"email": "default", "scopes": [
        "https://www.googleapis.com/auth/devstorage.read_write",  # gs:// data and checkpoints
        "https://www.googleapis.com/auth/compute"]}]  # the node's end (cloud/node_exit.py)
    script = template["metadata"]["items"][0]["value"]
    assert 'bamboo-agent" --etcd 10.0.0.5:2379 --job gpt' in script and "--notice gcp" in script
    group = compute.groups["bamboo-gcp"]
    assert [z["zone"] for z in group["distributionPolicy"]["zones"]] == [f"zones/{z}" for z in ZONES]
    assert group["targetSize"] == 3 and group["instanceTemplate"].endswith("instanceTemplates/bamboo-gcp")
    assert compute.polls >= 2  # both operations were waited on, through our endpoint

    provider.scale("bamboo-gcp", 5)
    instances = provider.describe("bamboo-gcp")
    assert len(instances) == 5 and {i["zone"] for i in instances} == set(ZONES)

    provider.down("bamboo-gcp")
    assert not compute.groups and not compute.templates


def test_unknown_zone_creates_nothing(compute):
    provider = GcpProvider("proj", "us-central1", compute.url)
    with pytest.raises(LaunchError, match="unknown zone.*europe-west1-b"):
        provider.check(("us-central1-a", "europe-west1-b"), "n1-standard-8", "nvidia-tesla-t4:1")
    with pytest.raises(LaunchError, match="machineTypes/n9-huge"):
        provider.check(ZONES, "n9-huge", "none")
    with pytest.raises(LaunchError, match="acceleratorTypes/nvidia-x"):
        provider.check(ZONES, "n1-standard-8", "nvidia-x:2")
    assert not compute.templates and not compute.groups


def test_refused_group_rolls_the_template_back(compute):
    compute.refuse.add("insert-group")
    with pytest.raises(LaunchError, match="QUOTA_EXCEEDED"):
        GcpProvider("proj", "us-central1", compute.url).up(spec())
    assert not compute.templates and not compute.groups


def launch(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "cloud.launch", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


@pytest.mark.slow
def test_launch_status_down_and_dry_run_through_the_command(compute, gcs, tmp_path):
    common = ["--nodes", "2", "--zones", ",".join(ZONES), "--region", "us-central1", "--project", "proj",
              "--image", "img", "--etcd", "auto", "--job", "gpt", "--endpoint-url", compute.url,
              "--package", "https://example.com/bamboo_spot-0.1.0-py3-none-any.whl", "--bucket", "ckpts/launches",
              "--storage-endpoint-url", gcs.url]
    state = str(tmp_path / "state.json")
    dry = launch("--state", state, "gcp", "--dry-run", *common)
    assert dry.returncode == 0, dry.stderr
    requests = [json.loads(line) for line in dry.stdout.splitlines()]
    assert [(r["service"], r.get("method") or r["operation"]) for r in requests] == [
        ("firewalls", "insert"), ("firewalls", "insert"), ("etcd", "put_if_not_exists"), ("instances", "insert"),
        *[("storage", "upload")] * (4 + 3), ("templates", "insert"), ("groups", "insert")]  # 4 member, 3 node files
    assert not compute.templates and not os.path.exists(state)

    up = launch("--state", state, "gcp", *common, "--service-account", "gpt-nodes@proj.iam.gserviceaccount.com")
    assert up.returncode == 0, up.stderr and compute.groups
    etcd_node = compute.instances["bamboo-etcd"]
    _admits_only_the_job(compute, "bamboo-gpt", ["bamboo-fw-job", "bamboo-fw-deny"])
    assert etcd_node["tags"]["items"] == ["bamboo-gpt"]
    properties = compute.templates["bamboo"]["properties"]
    assert properties["tags"]["items"] == ["bamboo-gpt"]
    assert [a["email"] for a in properties["serviceAccounts"]] == ["gpt-nodes@proj.iam.gserviceaccount.com"]
    assert "put /bamboo/gpt/config" in etcd_node["metadata"]["items"][0]["value"]
    assert etcd_node["serviceAccounts"][0]["scopes"] == ["https://www.googleapis.com/auth/devstorage.read_only"]
    made = read_records(state)["gpt"]
    assert made["priced_as"] == "n1-standard-8+t4"  # the dashboard's prices: the default machine and its T4
    shipped = {name for bucket, name in gcs.objects if bucket == "ckpts"}
    assert shipped == {u[len("gs://ckpts/"):] for u in made["certificates"]} and len(shipped) == 7
    assert all(name.startswith("launches/bamboo-launch/gpt/etcd-tls/") for name in shipped)
    assert 'bamboo-agent" --etcd 10.128.0.2:2379' in compute.templates["bamboo"]["properties"]["metadata"]["items"][0][
        "value"]
    assert f"bamboo-launch: watch the job: bamboo-launch --state {state} dashboard gpt" in up.stderr
    status = json.loads(launch("--state", state, "status", "--via", "gcloud").stdout)
    assert status["provider"] == "gcp" and len(status["instances"]) == 2
    # the tunnel to the etcd's private address is gcloud's: not installed here, or it cannot log in
    error = status["progress"]["error"]
    assert error.startswith(("--via gcloud: gcloud is not installed here", "the tunnel (gcloud compute ssh")), error
    assert status["dashboard"] == "bamboo-launch dashboard gpt"
    assert launch("--state", state, "down").returncode == 0
    assert not compute.groups and not compute.instances and not os.path.exists(state)
    assert not compute.firewalls and not any(bucket == "ckpts" for bucket, _ in gcs.objects)


def _admits_only_the_job(compute, tag: str, names: list[str]) -> None:
    """The job's instances reach each other on every port; every other source is
    denied all but SSH, ahead of the network's default-allow-internal (65534)."""
    allow, deny = (compute.firewalls[n] for n in names)
    assert (allow["sourceTags"], allow["targetTags"], allow["allowed"]) == ([tag], [tag], [{"IPProtocol": "all"}])
    assert (deny["sourceRanges"], deny["targetTags"]) == (["0.0.0.0/0"], [tag])
    assert deny["denied"] == [{"IPProtocol": "tcp", "ports": ["0-21", "23-65535"]}, {"IPProtocol": "udp"}]
    assert allow["priority"] < deny["priority"] < 65534 and allow["direction"] == deny["direction"] == "INGRESS"


def test_missing_google_credentials_is_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NO_GCE_CHECK": "True"}
    out = launch("--state", str(tmp_path / "s.json"), "gcp", "--nodes", "2", "--zones", "us-central1-a",
                 "--region", "us-central1", "--project", "p", "--image", "i", "--etcd", "auto", "--job", "j",
                 "--package", "https://example.com/b.whl", "--bucket", "b", env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "no Google credentials" in lines[0], out.stderr


def test_etcd_auto_without_a_bucket_for_its_certificates_is_one_line(tmp_path):
    out = launch("--state", str(tmp_path / "s.json"), "gcp", "--nodes", "2", "--zones", "us-central1-a",
                 "--region", "us-central1", "--project", "p", "--image", "i", "--etcd", "auto", "--job", "j",
                 "--package", "https://example.com/b.whl")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "give --bucket, or --etcd-plain" in lines[0], out.stderr


@pytest.mark.parametrize("extra, why", [
    (["--name", "Bamboo_1"], "--name 'Bamboo_1' is not a gcp resource name"),
    (["--machine-type", ""], "--machine-type must not be empty"),
    (["--machine-type", "g2-standard-8", "--accelerator", "nvidia-l4:1"],
     "--machine-type g2-standard-8 comes with 1 GPU(s): leave out --accelerator nvidia-l4:1"),
    (["--accelerator", "none", "--precision", "fp16", "--model", "tiny"],
     "--precision fp16 needs a GPU on each node: --machine-type n1-standard-8 with --accelerator none has none"),
])
def test_names_the_provider_would_refuse_are_refused_before_any_request(extra, why, tmp_path):
    """No credentials here: a request would fail with another message."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NO_GCE_CHECK": "True"}
    out = launch("--state", str(tmp_path / "s.json"), "gcp", "--nodes", "2", "--zones", "us-central1-a",
                 "--region", "us-central1", "--project", "p", "--image", "i", "--etcd", "auto", "--job", "j",
                 "--package", "https://example.com/b.whl", *extra, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and why in lines[0], out.stderr


@pytest.mark.slow
def test_etcd_auto_with_three_members_puts_one_in_each_zone(compute, tmp_path):
    state = str(tmp_path / "state.json")
    up = launch("--state", state, "gcp", "--nodes", "2", "--zones", ",".join(ZONES), "--region", "us-central1",
                "--project", "proj", "--image", "img", "--etcd", "auto", "--etcd-members", "3", "--job", "trio",
                "--endpoint-url", compute.url, "--package", "https://example.com/bamboo_spot-0.1.0-py3-none-any.whl",
                "--etcd-plain")
    assert up.returncode == 0, up.stderr
    assert "--etcd-plain: the job's etcd runs without TLS or auth" in up.stderr
    made = read_records(state)["trio"]
    assert made["certificates"] == [] and made["etcd_tls"] is None
    assert [i.split("/")[0] for i in made["etcd_instances"]] == list(ZONES)
    assert set(compute.instances) == {"bamboo-etcd", "bamboo-etcd-1", "bamboo-etcd-2"}
    assert len(made["etcd"].split(",")) == 3
    boot = compute.templates["bamboo"]["properties"]["metadata"]["items"][0]["value"]
    assert f'bamboo-agent" --etcd {made["etcd"]} ' in boot
    assert launch("--state", state, "down").returncode == 0
    assert not compute.instances


def test_a_four_gpu_machine_boots_four_workers(compute):
    """One worker per GPU (bamboo-agent --workers N): a2-highgpu-4g's own four, or
    the accelerator's count."""
    provider = GcpProvider("proj", "us-central1", compute.url)
    provider.up(GcpSpec(**{**spec("bamboo-a2").__dict__, "machine_type": "a2-highgpu-4g",
                           "accelerator": "nvidia-tesla-a100:4"}))
    script = compute.templates["bamboo-a2"]["properties"]["metadata"]["items"][0]["value"]
    assert "WORKERS=4; GPUS=4\n" in script and '--workers "$WORKERS"' in script
    assert '--expect-gpus "${BAMBOO_EXPECT_GPUS:-$GPUS}"' in script  # the agent checks torch sees them
    assert "WORKERS=2; GPUS=2\n" in GcpSpec(**{**spec().__dict__, "accelerator": "nvidia-tesla-t4:2"}).startup_script()
    assert "WORKERS=1; GPUS=0\n" in GcpSpec(**{**spec().__dict__, "accelerator": "none"}).startup_script()
    provider.down("bamboo-a2")
