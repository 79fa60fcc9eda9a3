"""A job's etcd admits only the job: checked from outside while a local job runs
(plain gRPC, plain HTTP, HTTPS without a certificate, another job's CA, a web
page's cross-origin request), and etcd's roles keep one job's user out of
another job's keys when two jobs share one etcd; the same for the etcd a cloud
launch starts, its boot script run here."""
import http.client
import os
import signal
import ssl
import subprocess
import sys
import time

import pytest

from bamboo.control.access import enable_auth, grant_job
from bamboo.control.credentials import ClientFiles, make_job_credentials
from bamboo.control.etcd import EtcdError, EtcdRefused, EtcdServer, connect, free_port, retry
from bamboo.control.protocol import CONFIG, ROOT, job_root, rendezvous_prefix
from commands.train.cli import config_from_args
from commands.train.flags import build_parser
from commands.train.launcher import Launcher
from cloud.common import Install, etcd_script
from cloud.etcd_tls import JobCertificates, member_folder
from cloud.package import build_wheel
from cloud.storage import S3Shipper, certificates_location
from tests.sandbox import boot_log, run_script

CROSS_ORIGIN = {"Origin": "http://attacker.example", "Content-Type": "text/plain"}
PUT = '{"key": "L2JhbWJvby9wd25lZA==", "value": "MQ=="}'  # a key of no job, base64


def _http(endpoint: str, context: ssl.SSLContext | None, headers=CROSS_ORIGIN) -> http.client.HTTPResponse:
    host, port = endpoint.rsplit(":", 1)
    conn = (http.client.HTTPSConnection(host, int(port), context=context, timeout=5) if context
            else http.client.HTTPConnection(host, int(port), timeout=5))
    conn.request("POST", "/v3/kv/put", body=PUT, headers=headers)
    return conn.getresponse()


def _context(ca: str, files: ClientFiles | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if files:
        context.load_cert_chain(files.cert, files.key)
    return context


def _outsider_checks(endpoint: str, tls_dir: str, other: str) -> dict:
    """What each kind of outsider gets from the running job's etcd."""
    job_files = ClientFiles.in_dir(tls_dir)
    seen = {}
    for name, tls in (("plain grpc", None), ("another job's CA", ClientFiles.in_dir(other))):
        try:
            connect(endpoint, timeout=2.0, tls=tls).get(ROOT)
            seen[name] = "answered"
        except EtcdError:
            seen[name] = "refused"
    for name, context in (("plain http", None), ("https without a certificate", _context(job_files.ca))):
        try:
            seen[name] = f"answered {_http(endpoint, context).status}"
        except (OSError, http.client.HTTPException):  # reset, TLS alert, empty reply
            seen[name] = "refused"
    reply = _http(endpoint, _context(job_files.ca, job_files))  # even the job's certificate, from a page
    seen["cross-origin header"] = reply.getheader("Access-Control-Allow-Origin")
    return seen


def test_a_local_jobs_etcd_refuses_everyone_but_the_job(tmp_path):
    other = make_job_credentials(str(tmp_path / "other"), "other")
    args = build_parser().parse_args(["--model", "tiny", "--stages", "2", "--microbatches", "2",
                                      "--iterations", "3", "--job", "guarded", "--no-progress"])
    launcher = Launcher(config_from_args(args), progress=False, named=True)
    seen, inside = {}, {}

    def look(launcher, cluster):
        if not seen:
            seen.update(_outsider_checks(launcher.server.endpoint, launcher.etcd_tls, other))
            inside["config"] = cluster.get(CONFIG()).cluster.job  # the job itself reads through the same etcd
            client = connect(launcher.server.endpoint, tls=ClientFiles.in_dir(launcher.etcd_tls))
            try:
                retry(lambda: client.put(job_root("other-job") + CONFIG().path, "1"), 5.0, launcher.server.endpoint)
            except EtcdRefused:
                inside["outside its prefix"] = "refused"
    launcher.on_tick = look
    summary = launcher.run()
    assert summary["iterations"] == 3
    assert inside == {"config": "guarded", "outside its prefix": "refused"}
    assert seen == {"plain grpc": "refused", "another job's CA": "refused", "plain http": "refused",
                    "https without a certificate": "refused", "cross-origin header": None}


def test_two_jobs_sharing_an_etcd_cannot_read_each_other(tmp_path):
    """One CA, two jobs' users: each reads and writes its own prefixes only."""
    tls = make_job_credentials(str(tmp_path / "tls"), "a", also=("b",))
    with EtcdServer(tls_dir=tls) as server:
        root = connect(server.endpoint, tls=server.admin)
        enable_auth(root, "a")
        grant_job(root, "b")
        a = connect(server.endpoint, tls=ClientFiles.in_dir(tls))
        b = connect(server.endpoint, tls=ClientFiles.in_dir(tls, "client-b"))
        config_a, config_b = job_root("a") + CONFIG().path, job_root("b") + CONFIG().path
        a.put(config_a, "secret of a")
        b.put(config_b, "b's")
        b.put(rendezvous_prefix("b") + "state", "b's rendezvous")
        assert b.get(config_b)[0] == b"b's"
        for request in (lambda: b.get(config_a), lambda: b.put(config_a, "x"), lambda: list(b.get_prefix(ROOT)),
                        lambda: b.delete(rendezvous_prefix("a") + "state")):
            with pytest.raises(EtcdRefused):
                retry(request, 5.0, server.endpoint)
        assert a.get(config_a)[0] == b"secret of a"


def test_the_plain_etcd_answers_no_cross_origin_page(etcd):
    """Tests' plain etcd too: etcd's gateway answers any origin by default."""
    reply = _http(etcd.endpoint, None)
    assert reply.status == 200  # the write is made (no TLS here) but a page may not read the answer
    assert reply.getheader("Access-Control-Allow-Origin") is None
    reply = _http(etcd.endpoint, None, headers={**CROSS_ORIGIN, "Host": "attacker.example"})
    assert reply.status >= 400  # a rebound name: refused by the Host check


def _wait_for_line(proc, root, line: str, timeout: float = 180.0) -> None:
    """Until the boot log shows `line` (the script says so once it serves)."""
    deadline = time.monotonic() + timeout
    while line not in boot_log(root):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the etcd script {'exited' if proc.poll() is not None else 'hung'}:\n{boot_log(root)[-3000:]}")
        time.sleep(0.5)


@pytest.mark.slow  # pip in the sandbox: minutes on a loaded machine (make test-slow)
def test_the_launched_etcd_boot_script_admits_only_the_job(s3, tmp_path):
    """The --etcd auto member's own boot script, run here under bash: it waits for
    its certificates in the bucket (moto), fetches them with the instance's
    identity, serves TLS only and turns auth on; the nodes' fetch gets the job's
    client certificate. Outsiders get what they get from a local job's etcd."""
    s3.create_bucket(Bucket="certs")
    shipper = S3Shipper("certs", "us-east-1", os.environ["BAMBOO_S3_ENDPOINT"], False)
    certs = JobCertificates("cloudjob", certificates_location(shipper, "cloudjob"), shipper.put,
                            Install(build_wheel(str(tmp_path / "wheelhouse"))))
    port, peer = free_port(), free_port()
    key = job_root("cloudjob") + CONFIG().path
    stored = '{"cluster": {"job": "cloudjob"}}'
    script = etcd_script(key, stored, "bamboo", "", certs.folder(member_folder(0)), "cloudjob", certs.install)
    root = tmp_path / "etcd-instance"
    proc = run_script(script, root, tmp_path / "wheelhouse", {  # its address: the one its folder names
        "BAMBOO_ETCD_PORT": str(port), "BAMBOO_ETCD_PEER_PORT": str(peer),
        **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "BAMBOO_S3_ENDPOINT")}}, venv_name="etcd")
    try:
        certs.member(0, "127.0.0.1")   # as a launch does, once the cloud gave the instance its address
        node_dir, fetch = str(tmp_path / "node-tls"), [sys.executable, "-m", "cloud.etcd_tls", "fetch"]
        early = subprocess.run([*fetch, certs.folder("node"), node_dir, "--role", "node"], capture_output=True,
                               text=True)
        assert early.returncode == 1 and early.stderr.count("\n") == 1 and "not there (yet)" in early.stderr
        certs.nodes(None)
        subprocess.run([*fetch, certs.folder("node"), node_dir, "--role", "node"], check=True)
        _wait_for_line(proc, root, "bamboo etcd: bamboo serves the job (https)")
        endpoint = f"127.0.0.1:{port}"
        job = connect(endpoint, tls=ClientFiles.in_dir(node_dir))
        assert job.get(key)[0] == stored.encode()
        with pytest.raises(EtcdRefused):
            retry(lambda: job.put(job_root("other-job") + CONFIG().path, "1"), 5.0, endpoint)
        other = make_job_credentials(str(tmp_path / "other"), "other")
        assert _outsider_checks(endpoint, node_dir, other) == {
            "plain grpc": "refused", "another job's CA": "refused", "plain http": "refused",
            "https without a certificate": "refused", "cross-origin header": None}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
