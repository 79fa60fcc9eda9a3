"""`bamboo-status --serve [HOST:]PORT`: a live web page of one job, read from its
etcd only (commands/status/jobview.py reads it through a read-only Cluster).

Routes: `/` the page (commands/status/dashboard_page.py), `/panels` its panels as
JSON (what the page's script fetches every --refresh seconds), `/api/job` the
whole summary as JSON (commands/status/runstats.py), for scripts.

It binds 127.0.0.1 unless told otherwise. On any other address every request
needs the token (`?token=T`, or `Authorization: Bearer T`): --token, or one made
up and printed with the URL; without it the answer is 403. A token is at least
MIN_TOKEN characters. On loopback, token or not, a request must name a loopback
host (a web page elsewhere cannot reach the dashboard through a DNS name that
resolves to 127.0.0.1).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from commands.status import dashboard_page, runstats
from commands.status.jobview import JobView, UnknownJob, open_job
from bamboo.control.etcd import EtcdError, EtcdLost

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MIN_TOKEN = 16  # characters of a --token: a shorter one is guessed
MAX_CONNECTIONS = 32  # served at once


class BadAddress(ValueError):
    """--serve's argument, in one line."""


def parse_address(text: str) -> tuple[str, int]:
    """PORT, HOST:PORT or [IPv6]:PORT; the host defaults to 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise BadAddress(f"--serve {text!r}: expected [HOST:]PORT, PORT a number below 65536")
    return host or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, treat it as reachable from elsewhere


class Dashboard:
    """What every request shares: the job's view, the prices, the token."""

    def __init__(self, view: JobView, price: tuple, refresh: float, token: str | None, host_guard: bool = True):
        self.view, self.price, self.refresh, self.token = view, price, refresh, token
        self.host_guard = host_guard  # bound to loopback: a request must name a loopback host, token or not

    def summary(self) -> dict:
        return runstats.summary(self.view.look(), self.price)


class Handler(BaseHTTPRequestHandler):
    """GET only; every answer is made from one look at etcd (a look younger than
    half a second is shared between requests)."""
    dashboard: Dashboard  # set on the subclass `start` makes
    server_version = "bamboo-dashboard"
    timeout = 20  # seconds a connection may stay silent (socket timeout)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self._allowed(url):
            self._send(403, "text/plain", "forbidden: this dashboard needs its token (?token=...)\n")
            return
        routes = {"/": self._page, "/panels": self._panels, "/api/job": self._job}
        if url.path not in routes:
            self._send(404, "text/plain", f"no page {url.path}: try / or /api/job\n")
            return
        try:
            routes[url.path]()
        except (EtcdError, EtcdLost) as e:
            self._send(503, "text/plain", f"etcd did not answer: {e}\n")
        except Exception as e:  # a bug (a write refused as ReadOnly, say): the page says so, stderr has the rest
            traceback.print_exc()
            self._send(500, "text/plain", f"{type(e).__name__}: {e}\n")

    def _allowed(self, url) -> bool:
        token = self.dashboard.token
        if self.dashboard.host_guard and _host_of(self.headers.get("Host", "")) not in LOOPBACK_NAMES:
            return False  # a page elsewhere, through a name rebound to loopback
        if token is None:
            return True
        given = parse_qs(url.query).get("token", [""])[0]
        bearer = self.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            given = given or bearer[len("Bearer "):]
        return hmac.compare_digest(given.encode(), token.encode())

    def _page(self) -> None:
        nonce = secrets.token_urlsafe(16)
        self._send(200, "text/html; charset=utf-8",
                   dashboard_page.page(self.dashboard.summary(), self.dashboard.refresh, nonce),
                   {"Content-Security-Policy": dashboard_page.policy(nonce)})

    def _panels(self) -> None:
        self._send(200, "application/json", json.dumps(dashboard_page.update(self.dashboard.summary())))

    def _job(self) -> None:
        self._send(200, "application/json", json.dumps(self.dashboard.summary()))

    def _send(self, status: int, kind: str, body: str, headers: dict | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        pass  # quiet: the terminal shows the URL, not every poll


class Server(ThreadingHTTPServer):
    """One thread per request (a page's polls and a script's reads at once), none
    of them keeping the process alive; `view` is the job's. At most MAX_CONNECTIONS
    at once (a connection over it is closed at once), each given up after
    Handler.timeout seconds of silence: idle connections cannot pile up threads."""
    daemon_threads = True
    request_queue_size = 64
    view: JobView

    def __init__(self, *args, **kwargs):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class Server6(Server):
    address_family = socket.AF_INET6


class CannotServe(RuntimeError):
    """A wrong address, etcd or job: one line for the user."""


def start(endpoint: str, job: str | None, address: str, token: str | None = None,
          price: tuple = (None, None), refresh: float = 2.0) -> tuple[Server, str]:
    """A server of the job's dashboard, bound and not yet serving, and its URL
    (with the token, when it needs one). CannotServe says what is wrong."""
    if token is not None and len(token) < MIN_TOKEN:
        raise CannotServe(f"--token: {len(token)} characters; a token needs at least {MIN_TOKEN}")
    try:
        host, port = parse_address(address)
        view = open_job(endpoint, job)
    except (BadAddress, UnknownJob, EtcdError, EtcdLost) as e:
        raise CannotServe(str(e)) from None
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(16)
    dashboard = Dashboard(view, price, refresh, token, host_guard=is_loopback(host))
    handler = type("JobHandler", (Handler,), {"dashboard": dashboard})
    try:
        server = (Server6 if ":" in host else Server)((host, port), handler)
    except OSError as e:
        view.close()
        raise CannotServe(f"--serve {address}: cannot listen there ({e.strerror or e})") from None
    server.view = view
    shown = f"[{host}]" if ":" in host else host
    return server, f"http://{shown}:{server.server_address[1]}/" + (f"?token={token}" if token else "")


def serve(endpoint: str, job: str | None, address: str, token: str | None, price: tuple, refresh: float) -> int:
    """Serve until interrupted; one line on stderr and status 2 when the address,
    the etcd or the job is wrong."""
    try:
        server, url = start(endpoint, job, address, token, price, refresh)
    except CannotServe as e:
        print(f"bamboo-status: error: {e}", file=sys.stderr)
        return 2
    print(f"bamboo-status: job {server.view.job} at {url} (Ctrl-C stops)", flush=True)
    serve_until_stopped(server)
    return 0


def serve_until_stopped(server: Server) -> None:
    """Serve until Ctrl-C (or server.shutdown from another thread), then close it."""
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop(server)


def stop(server: Server) -> None:
    """Close the server (after serve_forever returned) and its etcd client."""
    server.server_close()
    server.view.close()


def _host_of(header: str) -> str:
    """The host of a Host header (`name`, `name:port`, `[v6]:port`)."""
    if header.startswith("["):
        return header[1:header.find("]")]
    return header.rpartition(":")[0] if ":" in header else header
