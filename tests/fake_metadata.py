"""Both clouds' preemption-notice metadata on loopback: EC2's IMDSv2 (a session
token, then spot/instance-action) and GCP's instance/preempted (with its
Metadata-Flavor header), one tree per node under /<node>/ (or at /). A node's
notice is pending once its prefix is in `noticed`. Used by tests/integration/test_notices.py
and scripts/bench_short_pipelines.py."""
import http.server
import threading


class FakeMetadata(http.server.ThreadingHTTPServer):
    """Both clouds' metadata endpoints, one set per node under /<node>/ (or at /)."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.noticed: set[str] = set()  # node prefixes ("" for /) with a pending notice
        self.tokens: set[str] = set()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def _split(self) -> tuple[str, str]:
        parts = self.path.split("/", 2)
        return (parts[1], "/" + parts[2]) if len(parts) > 2 and parts[1].isdigit() else ("", self.path)

    def do_PUT(self):
        node, path = self._split()
        if path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            token = f"token-{len(self.server.tokens)}"
            self.server.tokens.add(token)
            return self._reply(200, token)
        self._reply(400)

    def do_GET(self):
        node, path = self._split()
        if path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
                return self._reply(401)
            if node in self.server.noticed:
                return self._reply(200, '{"action": "terminate", "time": "2026-11-22T05:00:00Z"}')
            return self._reply(404)
        if path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._reply(403)
            return self._reply(200, "TRUE" if node in self.server.noticed else "FALSE")
        self._reply(404)
