"""GCP end to end, offline: `bamboo-launch gcp` against the fake Compute Engine
and Cloud Storage (real google-cloud-compute and google-cloud-storage clients):
the wheel is uploaded, and (slow) the startup script runs under bash in the
sandbox with the fake GCP metadata server: the node reads the wheel with its
service account's token from the metadata server (no URL that expires), installs
it and trains."""
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import ZONES
from tests.fake_gcp import FakeCompute
from tests.fake_gcs import FakeStorage
from tests.sandbox import FakeMetadata, boot, boot_log
from tests.integration.test_boot import TRAIN, installed_from_wheel, losses, reference, wait_done

BIN = os.path.dirname(sys.executable)
ZONE_LIST = ("us-central1-a", "us-central1-b", "us-central1-c")


@pytest.fixture
def gcp(tmp_path, monkeypatch):
    compute, storage = FakeCompute(ZONE_LIST), FakeStorage()
    key = tmp_path / "sa.json"
    key.write_text(json.dumps(storage.service_account()))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    yield compute, storage
    compute.shutdown()
    storage.close()


def launch_gcp(gcp, etcd_endpoint, tmp_path, job, iterations, *extra):
    compute, storage = gcp
    return subprocess.run([os.path.join(BIN, "bamboo-launch"), "--state", str(tmp_path / "state.json"), "gcp",
                           "--nodes", "2", "--zones", ",".join(ZONE_LIST), "--region", "us-central1",
                           "--project", "proj", "--image", "img", "--etcd", etcd_endpoint, "--job", job,
                           "--name", job, "--endpoint-url", compute.url, "--storage-endpoint-url", storage.url,
                           *TRAIN, "--iterations", str(iterations), *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_wheel_goes_to_gcs_for_the_nodes_identity_and_down_removes_it(gcp, etcd, tmp_path):
    compute, storage = gcp
    up = launch_gcp(gcp, etcd.endpoint, tmp_path, "gcs-a", 3, "--bucket", "wheels/runs")
    assert up.returncode == 0, up.stderr
    [(bucket, name)] = storage.objects
    assert bucket == "wheels" and name.startswith("runs/bamboo-launch/gcs-a/bamboo_spot-")
    script = compute.templates["gcs-a"]["properties"]["metadata"]["items"][0]["value"]
    assert "X-Goog-Signature" not in script and "service-accounts/default/token" in script
    url = re.search(r"-H \"Authorization: Bearer \$TOKEN\" -o \S+ '([^']+)'", script).group(1)
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(url)  # no token, no wheel: the object is not public
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer t"})) as reply:
        assert reply.read() == storage.objects[(bucket, name)]
    status = json.loads(subprocess.run([os.path.join(BIN, "bamboo-status"), "--etcd", etcd.endpoint, "--job",
                                        "gcs-a", "--json"], capture_output=True, text=True).stdout)
    assert (status["model"], status["stages"], status["state"]) == ("tiny", 2, "configured")
    down = subprocess.run([os.path.join(BIN, "bamboo-launch"), "--state", str(tmp_path / "state.json"), "down"],
                          capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    assert not storage.objects and not compute.templates and not compute.groups


@pytest.mark.slow
def test_a_bucket_that_does_not_exist_leaves_nothing(gcp, etcd, tmp_path):
    compute, storage = gcp
    out = launch_gcp(gcp, etcd.endpoint, tmp_path, "gcs-b", 3, "--bucket", "no-such-bucket")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "no-such-bucket" in lines[0], out.stderr
    assert not storage.objects and not compute.templates and not os.path.exists(tmp_path / "state.json")


@pytest.mark.slow
def test_a_node_boots_from_the_gcp_startup_script_and_trains(gcp, etcd, tmp_path):
    compute, storage = gcp
    iterations = 4
    up = launch_gcp(gcp, etcd.endpoint, tmp_path, "gboot", iterations, "--bucket", "wheels")
    assert up.returncode == 0, up.stderr
    script = compute.templates["gboot"]["properties"]["metadata"]["items"][0]["value"]
    meta = FakeMetadata("us-central1-b", "4242")
    root = tmp_path / "node-g"
    (tmp_path / "wheelhouse").mkdir()
    node = boot(script, root, meta, tmp_path / "wheelhouse")
    peer = subprocess.Popen([os.path.join(BIN, "bamboo-agent"), "--etcd", etcd.endpoint, "--job", "gboot",
                             "--zone", "us-central1-c"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = Cluster(etcd.endpoint, "gboot")
    try:
        wait_done(cluster, iterations - 1, {"the booted node": (node, lambda: boot_log(root)),
                                            "the peer agent": (peer, lambda: "")})
        assert node.wait(60) == 0 and peer.wait(60) == 0, boot_log(root)[-3000:]
        assert {z.zone for z in cluster.children(ZONES()).values()} == {"us-central1-b", "us-central1-c"}
        assert "instance 4242 in zone us-central1-b" in boot_log(root)
        assert "meta-token-4242" in storage.bearers  # the wheel, read with the node's own token
        assert installed_from_wheel(str(root))
        assert losses(cluster, iterations) == pytest.approx(reference(tmp_path, iterations), rel=1e-9)
        # the job is complete: the node's end (cloud/node_exit.py) took its group to zero
        assert "status 0: finish" in boot_log(root) and compute.groups["gboot"]["targetSize"] == 0, boot_log(root)
    finally:
        for p in (node, peer):
            if p.poll() is None:
                os.killpg(p.pid, 9) if p is node else p.kill()
        cluster.close()
        meta.close()
