"""`bamboo-launch dashboard [JOB]` and `status` from this machine: a tunnel to the
job's etcd when it does not answer from here, then the live dashboard (or the
progress) through it. The tunnel is closed when they end.

The ways in (`--via`):

  direct  the etcd answers from here: your own etcd, or a machine inside the VPC
  ssm     EC2: Session Manager port forwarding to the `--etcd auto` instance
          (`aws ssm start-session`): no SSH key, no open port; needs the aws CLI
          and its session-manager-plugin here, and the instance's role allowed
          Session Manager (docs/cloud.md)
  gcloud  GCP: `gcloud compute ssh` to the `--etcd auto` instance, forwarding a port
  ssh     `ssh -L` through `--ssh-host USER@HOST` (`--ssh-key FILE`): a machine that
          reaches the etcd, such as the etcd instance launched with `--key-name`
          and a `--security-group` that admits your SSH

`auto` (the default) is ssm or gcloud for an `--etcd auto` job, direct otherwise. Each tunnel's local end is a port free at the
time, on loopback: a web page cannot guess it.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time

from cloud.common import LaunchError

VIAS = ("auto", "direct", "ssm", "gcloud", "ssh")
TUNNEL_SECONDS = 60.0   # a tunnel that does not accept a connection by then has failed


def reachable(endpoint: str, timeout: float) -> bool:
    """Whether HOST:PORT accepts a TCP connection within `timeout` seconds."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def first_endpoint(state: dict) -> str:
    """The etcd member a tunnel goes to: the launch's first."""
    return state["etcd"].split(",")[0]


def chosen_via(state: dict, via: str) -> str:
    """The way in `via` names; `auto`'s choice: the cloud's own tunnel to an `--etcd
    auto` instance (its address is private by construction), else direct. No probe
    decides it: a network that accepts any connection would fool one."""
    if via != "auto":
        return via
    if state.get("etcd_instance"):
        return "ssm" if state["provider"] == "ec2" else "gcloud"
    return "direct"


DIRECT_HINT = ("; if it answers only inside its network, give --via ssh --ssh-host USER@HOST (a machine that "
               "reaches it)")


def tunnel_command(state: dict, via: str, local: int, ssh_host: str | None, ssh_key: str | None) -> list[str]:
    """The command that forwards 127.0.0.1:`local` to the job's etcd."""
    host, _, port = first_endpoint(state).rpartition(":")
    zone, _, instance = (state.get("etcd_instance") or "").rpartition("/")
    if via == "ssm":
        if state["provider"] != "ec2" or not instance:
            raise LaunchError("--via ssm goes through an EC2 job's --etcd auto instance")
        return ["aws", "ssm", "start-session", "--region", state["region"], "--target", instance,
                "--document-name", "AWS-StartPortForwardingSession",
                "--parameters", f"portNumber={port},localPortNumber={local}"]
    if via == "gcloud":
        if state["provider"] != "gcp" or not instance:
            raise LaunchError("--via gcloud goes through a GCP job's --etcd auto instance")
        return ["gcloud", "compute", "ssh", instance, "--project", state["project"], "--zone", zone, "--quiet",
                "--", "-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{local}:127.0.0.1:{port}"]
    if not ssh_host:
        raise LaunchError("--via ssh needs --ssh-host USER@HOST: a machine you can ssh to that reaches the etcd")
    return ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", *(["-i", ssh_key] if ssh_key else []),
            "-L", f"127.0.0.1:{local}:{host}:{port}", ssh_host]


class Tunnel:
    """`with Tunnel(state, via) as endpoint:` the job's etcd as reached from here."""

    def __init__(self, state: dict, via: str = "auto", ssh_host: str | None = None, ssh_key: str | None = None):
        if via not in VIAS:
            raise LaunchError(f"--via {via!r}: choose from {', '.join(VIAS)}")
        self.state, self.via, self.ssh = state, via, (ssh_host, ssh_key)
        self.process: subprocess.Popen | None = None
        self.chosen: str | None = None  # the way in, once open
        self.said = None   # the tunnel's stderr: a file, so that a talkative tunnel never blocks

    def __enter__(self) -> str:
        via = self.chosen = chosen_via(self.state, self.via)
        if via == "direct":
            return first_endpoint(self.state)
        from bamboo.control.etcd import free_port
        local = free_port()
        command = tunnel_command(self.state, via, local, *self.ssh)
        self.said = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=self.said, start_new_session=True)
        except FileNotFoundError:
            self.said.close()
            raise LaunchError(f"--via {via}: {command[0]} is not installed here (docs/cloud.md, Watching)") from None
        try:
            self._wait_open(local, command)
        except BaseException:  # an interrupt while it opens closes it too
            self.close()
            raise
        return f"127.0.0.1:{local}"

    def _wait_open(self, local: int, command: list[str]) -> None:
        """Until the tunnel's local end accepts a connection; its exit or the
        deadline is a LaunchError with the tunnel's last line."""
        deadline = time.monotonic() + TUNNEL_SECONDS
        while not reachable(f"127.0.0.1:{local}", timeout=0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                self.said.seek(0)
                said = self.said.read(1 << 16).decode(errors="replace").strip().splitlines()
                raise LaunchError(f"the tunnel ({shlex.join(command[:3])} ...) did not open"
                                  + (f": {said[-1][:300]}" if said else ""))
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the tunnel's process (and anything it started), if it runs."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __exit__(self, *exc) -> None:
        self.close()
        if self.said is not None:
            self.said.close()


def close_on_signals() -> None:
    """SIGTERM and SIGHUP (a kill, a closed terminal) end this process as Ctrl-C
    does, through the `with` blocks: a tunnel never outlives its command."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)


def prices(state: dict) -> tuple:
    """(spot, on-demand) dollars per node-hour (a node: one GPU's worker) of the
    launch's instance types, their mean, from the instance table; (None, None) for
    a type it does not price."""
    from commands.train.instances import INSTANCES, per_gpu_prices
    names = state.get("instance_types") or [state.get("priced_as")]
    kinds = [INSTANCES.get(n) for n in names]
    if not kinds or None in kinds:
        return None, None
    return tuple(round(price, 4) for price in per_gpu_prices(kinds))


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def dashboard(state: dict, tunnel: Tunnel, port: int, browser: bool, seconds: float | None) -> None:
    """Serve the job's live dashboard on 127.0.0.1:`port` through `tunnel` until
    Ctrl-C (or `seconds`), priced at its instance types' prices."""
    import threading
    import webbrowser

    from commands.status.dashboard import CannotServe, serve_until_stopped, start
    if state.get("etcd_tls"):
        os.environ["BAMBOO_ETCD_TLS"] = state["etcd_tls"]  # the job's client certificate, for this process
    with tunnel as endpoint:
        try:
            server, url = start(endpoint, state["job"], f"127.0.0.1:{port}", price=prices(state))
        except CannotServe as e:
            hint = DIRECT_HINT if tunnel.chosen == "direct" and "--serve" not in str(e) else ""
            raise LaunchError(str(e).replace(f"--serve 127.0.0.1:{port}", f"--port {port}") + hint) from None
        print(f"bamboo-launch: job {state['job']}'s dashboard at {url} (Ctrl-C stops it)", flush=True)
        if browser:
            webbrowser.open(url)
        if seconds is not None:
            timer = threading.Timer(seconds, server.shutdown)
            timer.daemon = True  # an interrupt ends the process without waiting for it
            timer.start()
        serve_until_stopped(server)
