"""bamboo-status --serve: the live dashboard of a job, read from its etcd only.

A real local job (agents, a real etcd) has a node SIGKILLed from outside and a
standby brought in; a headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) keeps the page open from the start,
never reloading it, and the DOM must show the grid change, the failover and the
reconfiguration with their pauses, and exactly the losses the launcher wrote to
its metrics file. The reader is also checked on a job written key by key (a redo
clears iterations it had kept), the etcd's revision unchanged by every request;
a non-loopback bind refuses requests without its token; a bad etcd or job name
is one line and status 2.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from html import escape as html_escape

import psutil
import pytest

from commands.status import dashboard, jobview
from commands.status.jobview import open_job
from commands.status.runstats import summary
from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster, ReadOnly
from bamboo.control.config import JobConfig
from bamboo.control.etcd import EtcdServer, connect
from bamboo.control.protocol import (ASSIGNMENT, CONFIG, DONE, FAILED, ITERATION_FAMILIES, LOSS, PREEMPTED, REGROUP,
                                     ZONES, Failure, Loss, Preempted, Regroup, Report, Zone, job_root)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401  (the test extras')
    NO_BROWSER = None if CHROMIUM and DRIVER else "no Chromium here (apt-get install chromium chromium-driver)"
except ImportError:
    NO_BROWSER = "no selenium here (pip install -e '.[test]')"


# -- a job written key by key ----------------------------------------------------------
def write_iterations(cluster: Cluster, its, losses, nodes=(0, 1), epoch=0) -> None:
    """Iteration `it` ends at 1000 + it seconds, 1.5 s later from iteration 3 on (its
    epoch's handover: a pause). Every node's counter of activations sent stands at
    (it + 1) GB: 1 GB an iteration, the whole of it in a node's first report."""
    for it in its:
        end = 1000.0 + it + (1.5 if it >= 3 else 0.0)
        cluster.put_all({**{LOSS(it, g): Loss(losses[it] + g) for g in range(2)},
                         **{DONE(it, n): Report(rss_mb=1.0, time=end, epoch=epoch,
                                                sent_bytes={"send_act": (it + 1) * 10 ** 9}) for n in nodes}})


@pytest.fixture
def job(etcd):
    """Job `synthetic` (P=2, M=2, no redundancy: its training has no share of it):
    epoch 0 is nodes 0, 1 and standby 2; node 1 dies in iteration 2 and epoch 1 puts
    node 2 in its place from iteration 3."""
    cluster = Cluster(etcd.endpoint, "synthetic")
    cluster.put(CONFIG(), JobConfig.of(name="tiny", stages=2, microbatches=2, iterations=8, elastic=True,
                                       job="synthetic", redundancy="off"))
    cluster.put(ASSIGNMENT(0), Assignment(0, 0, ((0, 1),), standby=(2,)))
    for n, zone in enumerate("aba"):
        cluster.put(ZONES(n), Zone(zone))
    write_iterations(cluster, range(2), {0: 5.0, 1: 4.0})
    cluster.put(FAILED(1), Failure(2, 0, "Connection closed by peer"))
    write_iterations(cluster, [2], {2: 3.5}, nodes=(0,))
    cluster.put(ASSIGNMENT(1), Assignment(1, 3, ((0, 2),), failed=(1,)))
    write_iterations(cluster, range(3, 5), {3: 3.0, 4: 2.5}, nodes=(0, 2), epoch=1)
    yield cluster
    cluster.close()
    client = connect(etcd.endpoint)  # the next test's job starts from nothing
    client.delete_prefix(job_root("synthetic"))
    client.close()


def _ledger_of(etcd, job: str) -> dict[str, float]:
    """The dashboard's ledger of `job`, in node-seconds."""
    view = open_job(etcd.endpoint, job)
    try:
        return {k: v * 3600 for k, v in summary(view.look())["cost"]["ledger"].items()}
    finally:
        view.cluster.close()


def _forget(etcd, job: str) -> None:
    client = connect(etcd.endpoint)
    client.delete_prefix(job_root(job))
    client.close()


def test_the_pause_after_a_checkpoint_is_booked_as_checkpoint_writes(etcd):
    """Job `ckpt` (P=2, two nodes, no redundancy, --checkpoint-seconds 2): the
    boundaries after iterations 1 and 3 agreed on a checkpoint (REGROUP), so
    iterations 2 and 4 take 1.5 s against the usual 1 s. By hand: 2 nodes x 0.5 s
    in each is checkpoint writes, the rest of 5 timed iterations training."""
    cluster = Cluster(etcd.endpoint, "ckpt")
    try:
        cluster.put(CONFIG(), JobConfig.of(name="tiny", stages=2, microbatches=2, iterations=6, elastic=True,
                                           job="ckpt", redundancy="off", checkpoint="/tmp/unused",
                                           checkpoint_seconds=2))
        cluster.put(ASSIGNMENT(0), Assignment(0, 0, ((0, 1),)))
        end = 1000.0
        for it in range(6):
            end += 1.5 if it in (2, 4) else 1.0
            cluster.put_all({**{LOSS(it, g): Loss(1.0) for g in range(2)},
                             **{DONE(it, n): Report(rss_mb=1.0, time=end, epoch=0) for n in (0, 1)},
                             REGROUP(it, 0): Regroup((), False, checkpoint=it in (1, 3))})
        assert _ledger_of(etcd, "ckpt") == pytest.approx({"training": 2 * 5 * 1.0, "checkpoint writes": 2 * 2 * 0.5})
    finally:
        _forget(etcd, "ckpt")
        cluster.close()


def test_a_rolled_back_iteration_books_what_it_threw_away_as_redone_work(etcd):
    """Job `back` (P=2, nodes 0 and 1, then 0 and 2): iterations 0-4 end a second
    apart; iteration 5 was under way when node 1 was killed 0.75 s into it, and
    epoch 1 rolls back to the checkpoint before iteration 4 with node 2 (started at
    the job's start, in standby). Iteration 4 run again ends 5 s after iteration 3:
    its first run (1 s), 0.75 s of iteration 5, then 2.25 s of recovery and its
    1 s. By hand: 2 nodes x 1.75 s redone work, 2 x 2.25 s rollback."""
    cluster = Cluster(etcd.endpoint, "back")
    try:
        cluster.put(CONFIG(), JobConfig.of(name="tiny", stages=2, microbatches=2, iterations=8, elastic=True,
                                           job="back", redundancy="off"))
        cluster.put(ASSIGNMENT(0), Assignment(0, 0, ((0, 1),), standby=(2,)))
        for it in range(4):
            cluster.put_all({**{LOSS(it, g): Loss(1.0) for g in range(2)},
                             **{DONE(it, n): Report(rss_mb=1.0, time=1000.0 + it, epoch=0) for n in (0, 1)}})
        cluster.put(PREEMPTED(1), Preempted(5, 1003.0 + 1.75))
        cluster.put(FAILED(1), Failure(5, 0, "killed", time=1003.0 + 1.75 + 0.5))
        cluster.put(ASSIGNMENT(1), Assignment(1, 4, ((0, 2),), failed=(1,), restore="checkpoint", redo=True))
        for it, end in ((4, 1008.0), (5, 1009.0)):
            cluster.put_all({**{LOSS(it, g): Loss(1.0) for g in range(2)},
                             **{DONE(it, n): Report(rss_mb=1.0, time=end, epoch=1) for n in (0, 2)}})
        ledger = _ledger_of(etcd, "back")
        assert ledger["redone work"] == pytest.approx(2 * 1.75)
        assert ledger["rollback"] == pytest.approx(2 * 2.25)
        assert ledger["training"] == pytest.approx(2 * 3 + 2 * 2)  # iterations 1-3, then 4 and 5 again
    finally:
        _forget(etcd, "back")
        cluster.close()


def revision(endpoint: str) -> int:
    client = connect(endpoint)
    try:
        return client.get_response("/").header.revision
    finally:
        client.close()


def test_the_reader_keeps_iterations_forgets_a_redo_and_never_writes(etcd, job, monkeypatch):
    monkeypatch.setattr(jobview, "CHUNK", 2)  # a long job's first look, in pieces
    before = revision(etcd.endpoint)
    view = open_job(etcd.endpoint, "synthetic")
    first = summary(view.look(), price=(0.9, 3.06))
    assert revision(etcd.endpoint) == before
    assert [r["loss"] for r in first["series"]] == [5.5, 4.5, 4.0, 3.5, 3.0]  # the mean of 2 microbatches
    assert [r["seconds"] for r in first["series"]] == [None, 1.0, 1.0, 2.5, 1.0]
    assert [(e["type"], e["pause"]) for e in first["events"]][1:] == [("preemption", 0.0), ("reconfigure", 1.5)]
    # paid node-seconds: 3 nodes (0, 1 until its death in iteration 2, standby 2) for iterations 1 and 2, then
    # 2 for 2.5 s and 1 s; a node's fault-free rate: 4 samples in 1 s on 2 nodes
    cost = first["cost"]
    assert cost["node_hours"] * 3600 == pytest.approx(3 + 3 + 5 + 2) and cost["samples"] == 16
    assert cost["goodput"] == pytest.approx(16 / 13 / 2) and cost["spot"] == pytest.approx(13 / 3600 * 0.9)
    assert cost["on_demand"] == pytest.approx(16 / 2 / 3600 * 3.06)
    assert cost["on_demand_projected"] == pytest.approx(8 * 4 / 2 / 3600 * 3.06)
    # where they went, by hand: nodes 0 and 1 train in iterations 1 and 2 while node 2 waits in standby;
    # 0 and 2 train in 3 and 4, but for iteration 3's 1.5 s beyond the typical 1 s: epoch 1's handover
    assert {k: v * 3600 for k, v in cost["ledger"].items()} == pytest.approx(
        {"training": 2 + 2 + 2 * 1.0 + 2, "reconfiguration": 2 * 1.5, "standby": 1 + 1})
    (cell0, cell1), = first["epochs"][-1]["pipelines"]
    assert (cell1["node"], cell1["state"], cell1["replaces"]) == (2, "training", {"node": 1, "state": "dead"})
    old = first["epochs"][0]["pipelines"][0][1]
    assert (cell0["node"], old["node"], old["state"]) == (0, 1, "dead")
    assert [(e["type"], e["iteration"]) for e in first["events"]] == [("start", 0), ("preemption", 2),
                                                                       ("reconfigure", 3)]
    # iterations 3 and 4 are abandoned: a redo epoch clears them, as the agents do, and runs them again
    job.create_clearing(ASSIGNMENT(2), Assignment(2, 3, ((0, 2),), failed=(1,), redo=True, restore="peers"),
                        [(family(3), family(5)) for family in ITERATION_FAMILIES])
    view.fresh = 0.0
    assert [r["iteration"] for r in summary(view.look())["series"]] == [0, 1, 2]
    write_iterations(job, range(3, 5), {3: 7.0, 4: 6.0}, nodes=(0, 2), epoch=2)
    before = revision(etcd.endpoint)
    again = summary(view.look())
    assert [r["loss"] for r in again["series"]] == [5.5, 4.5, 4.0, 7.5, 6.5]
    assert ("redo", 3) in [(e["type"], e["iteration"]) for e in again["events"]]
    with pytest.raises(ReadOnly):
        view.cluster.put(CONFIG(), JobConfig.of(job="synthetic"))
    assert revision(etcd.endpoint) == before
    view.close()


def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def serving(*args, **kwargs):
    server, url = dashboard.start(*args, **kwargs)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server, url


def test_a_non_loopback_bind_needs_its_token_and_no_request_writes(etcd, job):
    server, url = serving(etcd.endpoint, "synthetic", "0.0.0.0:0", price=(0.9, 3.06))
    port, token = server.server_address[1], url.split("?token=")[1]
    base = f"http://127.0.0.1:{port}"
    before = revision(etcd.endpoint)
    try:
        assert url.startswith("http://0.0.0.0:") and len(token) >= 16  # made up and printed
        assert get(f"{base}/")[0] == 403 and get(f"{base}/api/job")[0] == 403
        assert get(f"{base}/?token=not-{token}")[0] == 403
        status, page = get(f"{base}/?token={token}")
        assert status == 200 and 'data-node="2" data-state="training"' in page
        status, body = get(f"{base}/api/job", {"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(body)["cost"]["spot_price"] == 0.9
        status, body = get(f"{base}/panels?token={token}")
        assert status == 200 and set(json.loads(body)["panels"]) == {"head", "cluster", "run", "timeline", "cost"}
        assert get(f"{base}/nothing?token={token}")[0] == 404
    finally:
        server.shutdown()
        dashboard.stop(server)
    local, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0")
    try:
        assert "token" not in url and get(url)[0] == 200
        assert get(url, {"Host": "attacker.example"})[0] == 403  # a DNS name rebound to loopback
    finally:
        local.shutdown()
        dashboard.stop(local)
    token = "t" * dashboard.MIN_TOKEN
    local, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0", token=token)
    try:  # a token on loopback keeps the Host guard: a rebound name with a leaked token is still refused
        assert url.endswith(f"?token={token}") and get(url)[0] == 200
        assert get(url, {"Host": "attacker.example"})[0] == 403
        assert get(url.split("?")[0])[0] == 403
    finally:
        local.shutdown()
        dashboard.stop(local)
    assert revision(etcd.endpoint) == before


def test_a_bad_etcd_job_or_address_is_one_line_and_status_2(etcd, job):
    cases = {"127.0.0.1:1": ("--serve", "0"), etcd.endpoint: ("--job", "nope", "--serve", "0")}
    runs = [subprocess.Popen([sys.executable, "-m", "commands.status.status", "--etcd", endpoint, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for endpoint, args in [*cases.items(), (etcd.endpoint, ("--job", "synthetic", "--serve", "host:port"))]]
    for run, needle in zip(runs, ("127.0.0.1:1", "no job 'nope'", "--serve 'host:port'")):
        out, err = run.communicate(timeout=120)
        assert run.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("bamboo-status: error: ") and needle in err, err


PAYLOADS = {"zone": '<img src=x onerror="alert(1)">', "host": "<script>alert(2)</script>",
            "how": "<svg onload=alert(3)>", "redundancy": '"><script>alert(4)</script>', "model": "<iframe src=//x>"}


def test_html_written_into_records_shows_as_text_under_a_policy(etcd, job):
    """Text from every record the page shows is escaped (a job's etcd may be written
    by anyone who reaches it); a record of the wrong shape leaves the page up; the
    page's own style and script carry the nonce its Content-Security-Policy names."""
    job.put(CONFIG(), JobConfig.of(name=PAYLOADS["model"], stages=2, microbatches=2, iterations=8, elastic=True,
                                   job="synthetic"))
    job.put(ZONES(2), Zone(PAYLOADS["zone"], PAYLOADS["host"]))
    job.put(FAILED(1), Failure(2, 0, PAYLOADS["how"]))
    job.put(ASSIGNMENT(1), Assignment(1, 3, ((0, 2),), failed=(1,), redundancy=PAYLOADS["redundancy"],
                                      restore="memory", redo=True))
    client = connect(etcd.endpoint)
    client.put(job.key(LOSS(4, 0)), json.dumps({"value": "<b>not a number</b>"}))  # malformed: left out
    bad = {**Assignment(2, 4, ((0, 2),)).to_dict(), "restore": "<b>5</b>"}  # not a restore source: left out
    client.put(job.key(ASSIGNMENT(2)), json.dumps(bad))
    client.close()
    server, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0")
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            page, policy = reply.read().decode(), reply.headers["Content-Security-Policy"]
        status, body = get(url.rstrip("/") + "/panels")
    finally:
        server.shutdown()
        dashboard.stop(server)
    assert status == 200
    nonce = policy.split("'nonce-")[1].split("'")[0]
    assert len(nonce) >= 16 and "script-src 'nonce-" in policy and "default-src 'none'" in policy
    assert page.count(f'nonce="{nonce}"') == 2  # the style and the script, nothing else
    panels = "".join(json.loads(body)["panels"].values())
    for name, payload in PAYLOADS.items():
        for html in (page, panels):
            assert payload not in html, name
        assert html_escape(payload) in page, name  # shown, as text
    assert "not a number" not in page and "&lt;b&gt;5" not in page and "<b>5" not in page
    assert 'id="panel-run"' in page


def test_idle_connections_are_capped_and_timed_out(etcd, job, monkeypatch):
    """Connections that never send a request hold no more than MAX_CONNECTIONS
    threads, and each is dropped after Handler.timeout: the page answers again."""
    import socket
    monkeypatch.setattr(dashboard.Handler, "timeout", 2)
    server, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0")
    before = threading.active_count()
    idle = [socket.create_connection(server.server_address, timeout=10) for _ in range(dashboard.MAX_CONNECTIONS + 8)]
    try:
        over = idle[-1].recv(1)  # over the cap: closed at once (b""), not held
        assert over == b""
        assert threading.active_count() <= before + dashboard.MAX_CONNECTIONS
        for s in idle[:dashboard.MAX_CONNECTIONS]:
            assert s.recv(1) == b""  # given up after the timeout
        assert get(url)[0] == 200
    finally:
        for s in idle:
            s.close()
        server.shutdown()
        dashboard.stop(server)


def test_a_short_or_empty_token_is_refused_in_one_line(etcd, job):
    """An empty --token would turn the token off; a short one is guessed."""
    for token in ("", "abc", "x" * (dashboard.MIN_TOKEN - 1)):
        run = subprocess.run([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint,
                              "--job", "synthetic", "--serve", "0", "--token", token],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert f"--token: {len(token)} characters" in run.stderr.splitlines()[-1], run.stderr
    with pytest.raises(dashboard.CannotServe, match="needs at least 16"):
        dashboard.start(etcd.endpoint, "synthetic", "127.0.0.1:0", token="abc")


def test_a_launch_says_how_to_open_its_dashboard_and_which_tunnel_that_opens():
    """The launch prints `bamboo-launch dashboard JOB`; the tunnels it would open
    forward a loopback port to the recorded etcd's (tests/integration/test_watch.py
    runs them)."""
    from cloud.common import LaunchError
    from cloud.manage import watch_command
    from cloud.watch import tunnel_command
    assert watch_command({"job": "gpt"}) == "bamboo-launch dashboard gpt"
    assert watch_command({"job": "gpt"}, "runs.json") == "bamboo-launch --state runs.json dashboard gpt"
    gcp = {"provider": "gcp", "project": "proj", "etcd": "10.128.0.2:2379", "job": "gpt",
           "etcd_instance": "us-central1-a/bamboo-etcd"}
    command = tunnel_command(gcp, "gcloud", 41873, None, None)
    assert command[:4] == ["gcloud", "compute", "ssh", "bamboo-etcd"] and "us-central1-a" in command
    assert command[-1] == "127.0.0.1:41873:127.0.0.1:2379" and "ExitOnForwardFailure=yes" in command
    ec2 = {"provider": "ec2", "region": "us-east-1", "etcd": "10.0.1.5:2379,10.0.2.5:2379", "job": "gpt",
           "etcd_instance": "i-0abc"}
    command = tunnel_command(ec2, "ssm", 41873, None, None)
    assert command[:3] == ["aws", "ssm", "start-session"] and "i-0abc" in command
    assert command[-1] == "portNumber=2379,localPortNumber=41873"
    assert tunnel_command(ec2, "ssh", 41873, "me@bastion", None)[-2:] == ["127.0.0.1:41873:10.0.1.5:2379",
                                                                          "me@bastion"]
    with pytest.raises(LaunchError, match="--via ssh needs --ssh-host"):
        tunnel_command(ec2, "ssh", 41873, None, None)
    with pytest.raises(LaunchError, match="--via gcloud goes through a GCP job"):
        tunnel_command(ec2, "gcloud", 41873, None, None)


# -- a real job in a real browser ------------------------------------------------------
def node_processes(proc: subprocess.Popen, node: int) -> list[psutil.Process]:
    """The agent and the worker of `node`, among the job's processes."""
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--node" in cmd and cmd[cmd.index("--node") + 1] == str(node):
            found.append(p)
    return found


def until(predicate, what: str, timeout: float = 240, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert proc is None or proc.poll() is None, f"the job exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)
    return found


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1250"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def cell(driver, pipeline: int, stage: int, table: str = "#grid-current") -> dict:
    """The grid cell's node and state, and whom it replaced, read from the DOM ({} if absent)."""
    return driver.execute_script("""
        const c = document.querySelector(
            arguments[0] + ` td[data-pipeline="${arguments[1]}"][data-stage="${arguments[2]}"]`);
        if (!c) return {};
        const r = c.querySelector(".replaces");
        return {node: c.dataset.node, state: c.dataset.state, replaces: r ? [r.dataset.node, r.dataset.state] : null};
    """, table, pipeline, stage)


# (the job's flags, the node killed, and whether the test kills it from outside once
# iteration 3 is done, or the job's own --preempt does)
SMALL = (["--model", "tiny", "--stages", "2", "--microbatches", "4", "--iterations", "40", "--local-nodes", "3",
          "--zones", "a,b", "--max-stages-per-node", "1", "--eval-every", "10",
          "--surplus", "keep"], 1, True)  # two trainers justify no standby by the burst rule: kept, it waits
DEMO = (["--model", "tiny", "--stages", "4", "--microbatches", "8", "--iterations", "30", "--local-nodes", "6",
         "--zones", "a,b,c", "--preempt", "2@15:10"], 2, False)  # make demo's job: the README's screenshot


@pytest.mark.slow
@pytest.mark.skipif(NO_BROWSER is not None, reason=NO_BROWSER or "")
@pytest.mark.parametrize("args, victim, from_outside", [SMALL, DEMO],
                         ids=["standby", "demo"])
def test_a_browser_watches_a_node_die_and_another_take_its_place(tmp_path, args, victim, from_outside):
    """The page is opened once, before the job's first epoch, and never reloaded.
    BAMBOO_DASHBOARD_SCREENSHOT=docs/dashboard.png keeps the last view there
    (the README's, from the demo's job: `pytest -m slow -k demo`)."""
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        job = subprocess.Popen([sys.executable, "-m", "commands.train.cli", *args, "--etcd", etcd.endpoint, "--job",
                                "watched", "--no-progress", "--metrics-out", str(metrics)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cluster = Cluster(etcd.endpoint, "watched", read_only=True)
        server = driver = None
        try:
            until(lambda: cluster.get(CONFIG()), "the job's config", proc=job)
            server = subprocess.Popen([sys.executable, "-m", "commands.status.status", "--etcd", etcd.endpoint,
                                       "--job", "watched", "--serve", "127.0.0.1:0", "--refresh", "0.25",
                                       "--price", "0.9,3.06"], stdout=subprocess.PIPE, text=True)
            driver = browser()  # starts while the nodes start
            url = server.stdout.readline().split(" at ")[1].split()[0]
            driver.get(url)
            driver.execute_script("window.loadedOnce = true")  # gone if the page were ever reloaded
            place, seen = watch_the_kill(driver, job, cluster, victim, from_outside)
            out, err = job.communicate(timeout=300)
            assert job.returncode == 0, err[-2000:]
            records = [r for r in map(json.loads, open(metrics)) if "summary" not in r]
            last = str(records[-1]["iteration"])
            until(lambda: driver.find_element("tag name", "body").get_attribute("data-iteration") == last,
                  "the page to show the last iteration", timeout=60)
            check_page(driver, records, victim, place, seen, from_outside)
            shot = os.environ.get("BAMBOO_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
            driver.save_screenshot(shot)
            assert pathlib.Path(shot).stat().st_size > 10_000
        finally:
            for p in (job, server):
                if p and p.poll() is None:
                    p.kill()
                    p.communicate()
            if driver:
                driver.quit()
            cluster.close()


def place_of(driver, node: int) -> tuple[int, int] | None:
    """(pipeline, stage) of `node`'s first cell in the current grid, as the page shows it."""
    found = driver.execute_script("""const c = document.querySelector(`#grid-current td[data-node="${arguments[0]}"]`);
        return c ? [Number(c.dataset.pipeline), Number(c.dataset.stage)] : null;""", node)
    return tuple(found) if found else None


def watch_the_kill(driver, job, cluster, victim: int, from_outside: bool) -> tuple[tuple[int, int], list[tuple]]:
    """The victim shown training; killed (agent and worker, from outside once
    iteration 3 is done, or by its --preempt); then every state the page showed
    at its place until another node is there: (its place, the states seen)."""
    place = until(lambda: place_of(driver, victim), f"the page to show node {victim} in the grid", proc=job)
    assert cell(driver, *place)["state"] == "training"
    if from_outside:
        until(lambda: cluster.children(DONE(3)), "iteration 3", proc=job)
        for p in node_processes(job, victim):
            p.send_signal(signal.SIGKILL)
    seen, deadline = [], time.monotonic() + 240
    while not seen or seen[-1][0] == str(victim):
        now = cell(driver, *place)
        if now and (not seen or seen[-1] != (now["node"], now["state"], now["replaces"])):
            seen.append((now["node"], now["state"], now["replaces"]))
        assert time.monotonic() < deadline and job.poll() in (None, 0), seen
        time.sleep(0.05)
    return place, seen


def check_page(driver, records: list[dict], victim: int, place: tuple[int, int], seen: list[tuple],
               from_outside: bool) -> None:
    assert driver.execute_script("return window.loadedOnce === true"), "the page was reloaded"
    assert int(driver.find_element("tag name", "body").get_attribute("data-polls")) > 10
    # the grid: the victim seen dead (in its epoch-0 place, and named where another node now is), and
    # in its place the node the metrics' reconfiguration names
    reconfigured, epoch = next((r["iteration"], e) for r in records for e in r["events"]
                               if e["type"] == "reconfigure" and e["epoch"] == 1)
    successor = str(epoch["pipelines"][place[0]][place[1]])
    assert seen[0][:2] == (str(victim), "training") and seen[-1] == (successor, "training", [str(victim), "dead"])
    old = cell(driver, *place, table='table.grid-old[data-epoch="0"]')
    assert old == {"node": str(victim), "state": "dead", "replaces": None}
    # the timeline: the failover and the reconfiguration where the metrics put them, each with its pause
    rows = driver.execute_script("""return [...document.querySelectorAll("tr.event")].map(
        r => [r.dataset.type, r.dataset.iteration, r.dataset.pause]);""")
    # a kill from outside lands inside an iteration (a failover), or between two, where
    # the boundary finds it (then no failover: the next epoch leaves the node out)
    failovers = [r["iteration"] for r in records for e in r["events"] if e["type"] == "failover"]
    assert [(int(r[1]), float(r[2]) >= 0) for r in rows if r[0] == "failover"] == [(i, True) for i in failovers]
    assert len(failovers) == 1 or (from_outside and failovers == [])
    (c,) = [r for r in rows if r[0] == "reconfigure"]
    assert int(c[1]) == reconfigured and float(c[2]) > 0, rows
    deaths = [int(r[1]) for r in rows if r[0] == "preemption"]  # the victim's death
    assert deaths == failovers if failovers else len(deaths) == 1 and deaths[0] <= reconfigured
    # the loss series: one point per iteration done, each the loss the launcher wrote
    points = driver.execute_script("""return [...document.querySelectorAll("#chart-loss circle.point")].map(
        c => [Number(c.dataset.it), Number(c.dataset.v)]);""")
    assert points == [[r["iteration"], r["loss"]] for r in records]
    validated = driver.execute_script("""return [...document.querySelectorAll("#chart-loss rect.extra")].map(
        c => [Number(c.dataset.it), Number(c.dataset.v)]);""")
    assert validated == [[r["iteration"], r["val_loss"]] for r in records if "val_loss" in r]


@pytest.mark.skipif(NO_BROWSER is not None, reason=NO_BROWSER or "")
def test_a_browser_shows_html_from_records_as_text_and_its_script_runs_under_the_policy(etcd, job):
    """The synthetic job with HTML in every text field, in headless Chromium: the page's
    own script runs (it polls the panels) under its Content-Security-Policy, no
    payload became an element, and each shows as the text it is."""
    job.put(ZONES(2), Zone(PAYLOADS["zone"], PAYLOADS["host"]))
    job.put(FAILED(1), Failure(2, 0, PAYLOADS["how"]))
    server, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0", refresh=0.2)
    driver = browser()
    try:
        driver.get(url)
        until(lambda: int(driver.execute_script("return document.body.dataset.polls")) >= 2,
              "two polls of the panels by the page's script", timeout=60)
        made = driver.execute_script("return document.querySelectorAll('main img, main script, main svg[onload],"
                                     " main iframe').length")
        assert made == 0
        text = driver.execute_script("return document.querySelector('main').innerText")
        for name in ("zone", "host", "how"):
            assert PAYLOADS[name] in text, name
    finally:
        driver.quit()
        server.shutdown()
        dashboard.stop(server)


@pytest.mark.skipif(NO_BROWSER is not None, reason=NO_BROWSER or "")
def test_a_browser_shows_where_the_paid_node_hours_went(etcd, job):
    """The cost panel, in headless Chromium, as the page's own script draws it: the
    synthetic job's node-hours by part, with their dollars at 0.9 a node-hour, the
    parts as counted by hand (8 s training, 3 s of the reconfiguration, 2 s of
    standby, 13 s paid); and its bytes by hand: node 0 sent 5 GB of activations, 3
    of them in epoch 0 to node 1 in zone b (crossing), 2 in epoch 1 to node 2 in its
    own zone a; nodes 1 and 2 ran the last stage (2 and 5 GB counted, none sent on).
    12 GB sent, 3 GB between zones, at 0.01 a GiB."""
    server, url = serving(etcd.endpoint, "synthetic", "127.0.0.1:0", price=(0.9, 3.06, 0.01), refresh=0.2)
    driver = browser()
    try:
        driver.get(url)
        until(lambda: int(driver.execute_script("return document.body.dataset.polls")) >= 2,
              "two polls of the panels by the page's script", timeout=60)
        rows = driver.execute_script(
            "return [...document.querySelectorAll('table.cost tr')].map(r => [r.cells[0].innerText, r.cells[1]"
            ".innerText])")
        shown = dict(rows)
        for part, seconds in (("training", 8), ("reconfiguration", 3), ("standby", 2)):
            hours = seconds / 3600
            assert shown[f"node-hours: {part}"] == f"{hours:.4g} (${hours * 0.9:,.4g})", part
        assert shown["paid node-hours (standby included)"] == f"{13 / 3600:.4g}"
        assert shown["bytes sent (the workers' counters)"] == "12 GB"
        assert shown["bytes between zones"] == f"3 GB (${3e9 / 2 ** 30 * 0.01:,.4g})"
    finally:
        driver.quit()
        server.shutdown()
        dashboard.stop(server)
