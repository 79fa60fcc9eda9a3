"""A small fake of Cloud Storage on loopback for the real google-cloud-storage
client: the OAuth token endpoint a service account's credentials refresh at, the
JSON API's multipart upload, delete, object metadata, listing (paged) and media
downloads (with x-goog-hash, pinned to a generation, whole or a byte range; a read
without a bearer token is refused, as GCS refuses an anonymous caller), and XML-API
GETs of V4 signed URLs (the signature checked against the service account's public key).
`requests` records (method, route) of every storage call, so tests can count
downloads."""
import base64
import hashlib
import http.server
import itertools
import json
import threading
from urllib.parse import parse_qs, unquote, urlparse

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa


class FakeStorage(http.server.ThreadingHTTPServer):
    def __init__(self, buckets=("wheels",)):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects: dict[tuple[str, str], bytes] = {}
        self.buckets = set(buckets)
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.generations: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str]] = []
        self._next = itertools.count(1000)
        self.signed_gets = 0
        self.bearers: list[str] = []  # the access token of each JSON API read, in order
        self.page_size = 1000  # GCS's own; a test may shrink it to exercise paging
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def service_account(self) -> dict:
        """A key file, as GOOGLE_APPLICATION_CREDENTIALS names one."""
        pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()).decode()
        return {"type": "service_account", "project_id": "proj", "private_key_id": "k1", "private_key": pem,
                "client_email": "launcher@proj.iam.gserviceaccount.com", "client_id": "1",
                "token_uri": f"{self.url}/token"}

    def put(self, bucket: str, name: str, data: bytes) -> int:
        """Store an object (a new generation, as every GCS write makes)."""
        self.objects[(bucket, name)] = data
        self.generations[(bucket, name)] = generation = next(self._next)
        return generation

    def resource(self, bucket: str, name: str) -> dict:
        import google_crc32c
        data = self.objects[(bucket, name)]
        return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)),
                "generation": str(self.generations.get((bucket, name), 1)),
                "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
                "crc32c": base64.b64encode(google_crc32c.Checksum(data).digest()).decode()}

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, body=b"", kind="application/json") -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, bucket: str):
        self._reply(404, {"error": {"code": 404, "message": f"The specified bucket does not exist: {bucket}"}})

    def do_POST(self):
        url = urlparse(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if url.path == "/token":
            return self._reply(200, {"access_token": "fake-token", "expires_in": 3600, "token_type": "Bearer"})
        parts = url.path.split("/")  # /upload/storage/v1/b/BUCKET/o
        if url.path.startswith("/upload/storage/v1/b/") and parts[-1] == "o":
            bucket = parts[5]
            if bucket not in self.server.buckets:
                return self._missing(bucket)
            boundary = self.headers["Content-Type"].split("boundary=")[1].strip('"').encode()
            sections = [p for p in body.split(b"--" + boundary) if p.strip() not in (b"", b"--")]
            meta = json.loads(sections[0].split(b"\r\n\r\n", 1)[1])
            data = sections[1].split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
            self.server.requests.append(("POST", "upload"))
            self.server.put(bucket, meta["name"], data)
            return self._reply(200, self.server.resource(bucket, meta["name"]))
        self._reply(404, {"error": {"code": 404, "message": f"no route POST {url.path}"}})

    def do_DELETE(self):
        parts = urlparse(self.path).path.split("/")  # /storage/v1/b/BUCKET/o/NAME
        key = (parts[4], unquote(parts[6]))
        if self.server.objects.pop(key, None) is None:
            return self._reply(404, {"error": {"code": 404, "message": "No such object"}})
        self._reply(204)

    def do_GET(self):
        url = urlparse(self.path)
        if url.path.startswith(("/storage/v1/b/", "/download/storage/v1/b/")):
            return self._json_get(url)
        bucket, _, name = url.path.lstrip("/").partition("/")
        data = self.server.objects.get((bucket, unquote(name)))
        if data is None:
            return self._reply(404, b"NoSuchKey", "text/plain")
        if not self._signed(url):
            return self._reply(403, b"SignatureDoesNotMatch", "text/plain")
        self.server.signed_gets += 1
        self._reply(200, data, "application/octet-stream")

    def _signed(self, url) -> bool:
        """A V4 signature over the canonical request, by the service account's key."""
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if q.get("X-Goog-Algorithm") != "GOOG4-RSA-SHA256" or "X-Goog-Signature" not in q:
            return False
        from urllib.parse import quote
        query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in sorted(q.items())
                         if k != "X-Goog-Signature")
        canonical = "\n".join(["GET", url.path, query, f"host:{self.headers['Host']}\n", q["X-Goog-SignedHeaders"],
                               "UNSIGNED-PAYLOAD"])
        scope = q["X-Goog-Credential"].split("/", 1)[1]
        to_sign = "\n".join(["GOOG4-RSA-SHA256", q["X-Goog-Date"], scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        try:
            self.server.key.public_key().verify(bytes.fromhex(q["X-Goog-Signature"]), to_sign.encode(),
                                                padding.PKCS1v15(), hashes.SHA256())
            return True
        except Exception:  # noqa: BLE001 -- any mismatch is a refusal
            return False

    def _json_get(self, url):
        """Metadata (/storage/v1/b/B/o/NAME), a listing (/storage/v1/b/B/o) or the
        bytes (/download/storage/v1/b/B/o/NAME?alt=media)."""
        media = url.path.startswith("/download/")
        parts = url.path.split("/")[3 if media else 2:]  # ["v1", "b", BUCKET, "o", NAME]
        bucket, name = parts[2], unquote("/".join(parts[4:]))
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.requests.append(("GET", "media" if media else "metadata" if name else "list"))
        bearer = self.headers.get("Authorization", "")
        if not bearer.startswith("Bearer "):
            return self._reply(401, {"error": {"code": 401, "message": "Anonymous caller"}})
        self.server.bearers.append(bearer[len("Bearer "):])
        if bucket not in self.server.buckets:
            return self._missing(bucket)
        if not name:
            return self._list(bucket, q)
        key = (bucket, name)
        if key not in self.server.objects or ("generation" in q and
                                              int(q["generation"]) != self.server.generations.get(key, 1)):
            return self._reply(404, {"error": {"code": 404, "message": f"No such object: {bucket}/{name}"}})
        if not media:
            return self._reply(200, self.server.resource(bucket, name))
        meta = self.server.resource(bucket, name)
        data, whole = self.server.objects[key], len(self.server.objects[key])
        ranged = self.headers.get("Range", "").startswith("bytes=")
        if ranged:  # bytes=FIRST-LAST, both inclusive
            first, last = (int(v) for v in self.headers["Range"][len("bytes="):].split("-"))
            data = data[first:last + 1]
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-goog-generation", meta["generation"])
        if ranged:
            self.send_header("Content-Range", f"bytes {first}-{first + len(data) - 1}/{whole}")
        self.send_header("x-goog-hash", f"crc32c={meta['crc32c']},md5={meta['md5Hash']}")
        self.end_headers()
        self.wfile.write(data)

    def _list(self, bucket: str, q: dict):
        names = sorted(n for b, n in self.server.objects if b == bucket and n.startswith(q.get("prefix", "")))
        start, size = int(q.get("pageToken", 0)), int(q.get("maxResults", self.server.page_size))
        page = {"kind": "storage#objects",
                "items": [self.server.resource(bucket, n) for n in names[start:start + size]]}
        if start + size < len(names):
            page["nextPageToken"] = str(start + size)
        self._reply(200, page)
