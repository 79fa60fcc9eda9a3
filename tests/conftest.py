"""Shared test settings: hypothesis profile sized for a 2-core CI machine. In CI
(CI=true) the examples are derandomized, so a run there is repeatable; a local
run explores new examples each time. `moto_endpoint`: a moto server on loopback
(S3, EC2, autoscaling) for the real boto3 client; `etcd`: a real etcd server;
`gcs`: the fake Cloud Storage, with credentials and endpoint in the environment
(so subprocesses reach it too), and `s3`: moto's S3 the same way; both give this
test a data cache of its own."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, settings

from bamboo.control.etcd import EtcdServer

settings.register_profile("ci", deadline=None, max_examples=60, derandomize=bool(os.environ.get("CI")),
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


@pytest.fixture(scope="session")
def moto_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    from tests.fake_gcs import FakeStorage
    fake = FakeStorage(buckets=("data", "ckpts"))
    key = tmp_path / "gcs-key.json"
    key.write_text(json.dumps(fake.service_account()))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    monkeypatch.setenv("BAMBOO_GCS_ENDPOINT", fake.url)
    monkeypatch.setenv("BAMBOO_DATA_CACHE", str(tmp_path / "cache"))
    yield fake
    fake.close()


@pytest.fixture
def s3(moto_endpoint, tmp_path, monkeypatch):
    """A boto3 client of moto's S3; BAMBOO_S3_ENDPOINT points bamboo there."""
    import boto3
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "BAMBOO_S3_ENDPOINT": moto_endpoint, "BAMBOO_DATA_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    return boto3.client("s3", endpoint_url=moto_endpoint)


@pytest.fixture(autouse=True)
def _heartbeats_end_with_their_test(monkeypatch):
    """A heartbeat a test left running (an in-process Cluster.register or
    Membership) would, at its hang deadline minutes later, print its warning into
    whichever test is capturing stderr then: each one a test starts stops at its end."""
    from bamboo.control.liveness import Heartbeat
    started = []
    take = Heartbeat._take_lease

    def recorded(self):
        started.append(self)
        take(self)
    monkeypatch.setattr(Heartbeat, "_take_lease", recorded)
    yield
    for heartbeat in started:
        heartbeat.halt()
