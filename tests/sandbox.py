"""A local sandbox in which a generated boot script runs for real under bash: a
fake instance metadata server per node (EC2's IMDSv2: a session token, then the
zone, the instance id, spot/instance-action and the instance role's credentials,
which boto3 on the node fetches as on EC2 and a moto server takes; GCP's metadata server with its
Metadata-Flavor header: zone, id, preempted, the service account's access token), a root directory standing for the
node's disk, and pip that installs from local files only (PIP_NO_INDEX).

The node's venv is prepared with a .pth line to this test venv's site-packages,
as an image with the dependencies baked in would be: pip finds torch and the
rest installed and installs the project itself from the wheel the script fetched."""
import http.server
import json
import os
import subprocess
import sys
import sysconfig
import threading


ROLE = "bamboo-node"  # the instance profile's role, as IMDS names it


class FakeMetadata(http.server.ThreadingHTTPServer):
    def __init__(self, zone: str, instance: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.zone, self.instance = zone, instance
        self.token = f"token-{instance}"
        self.action: dict | None = None      # the spot notice, once given
        self.requests: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def notice(self) -> None:
        self.action = {"action": "terminate", "time": "2030-01-01T00:00:00Z"}

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, text: str = "") -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        s = self.server
        s.requests.append("PUT " + self.path)
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._reply(200, s.token)
        self._reply(400)

    def do_GET(self):
        s = self.server
        s.requests.append("GET " + self.path)
        if self.path.startswith("/computeMetadata/v1/"):
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._reply(403)
            answers = {"instance/zone": f"projects/123/zones/{s.zone}", "instance/id": s.instance,
                       "instance/name": f"node-{s.instance}",
                       "instance/preempted": "TRUE" if s.action else "FALSE",
                       "instance/service-accounts/default/token": json.dumps(
                           {"access_token": f"meta-token-{s.instance}", "expires_in": 3599, "token_type": "Bearer"})}
            found = answers.get(self.path[len("/computeMetadata/v1/"):])
            return self._reply(200, found) if found is not None else self._reply(404)
        if self.headers.get("X-aws-ec2-metadata-token") != s.token:
            return self._reply(401)  # IMDSv2: no session token, no answer
        answers = {"placement/availability-zone": s.zone, "instance-id": s.instance,
                   "spot/instance-action": json.dumps(s.action) if s.action else None,
                   "iam/security-credentials/": ROLE, f"iam/security-credentials/{ROLE}": json.dumps(
                       {"Code": "Success", "AccessKeyId": "test", "SecretAccessKey": "test", "Token": "test",
                        "Expiration": "2099-01-01T00:00:00Z", "LastUpdated": "2026-01-01T00:00:00Z",
                        "Type": "AWS-HMAC"})}
        found = answers.get(self.path[len("/latest/meta-data/"):]) if self.path.startswith("/latest/meta-data/") \
            else None
        self._reply(200, found) if found is not None else self._reply(404)


def prepare_root(root, venv_name: str = "bamboo") -> None:
    """The node's disk: a venv whose .pth reaches this venv's dependencies."""
    venv = os.path.join(root, "opt", venv_name)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", venv], check=True)
    site = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
    with open(os.path.join(site, "image-dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")


def boot(script: str, root, metadata: FakeMetadata, wheelhouse) -> subprocess.Popen:
    """Run `script` as the node's boot: bash, the sandbox's root and metadata."""
    return run_script(script, root, wheelhouse, {"BAMBOO_METADATA": metadata.url,
                                                 "AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata.url,
                                                 "BAMBOO_EXPECT_GPUS": "0"})  # this machine has none


def run_script(script: str, root, wheelhouse, env: dict, venv_name: str = "bamboo") -> subprocess.Popen:
    """Run a generated boot script under bash in the sandbox's root, with `env` added."""
    prepare_root(root, venv_name)
    path = os.path.join(root, "boot.sh")
    with open(path, "w") as f:
        f.write(script)
    shims = os.path.join(root, "shims")  # python3 is the interpreter this venv was made from
    os.makedirs(shims, exist_ok=True)
    os.symlink(sys._base_executable, os.path.join(shims, "python3"))
    env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(root), "BAMBOO_ROOT": str(root), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(wheelhouse), "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           **env}
    log = open(os.path.join(root, "boot.log"), "w")
    return subprocess.Popen(["bash", path], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def boot_log(root) -> str:
    with open(os.path.join(root, "boot.log")) as f:
        return f.read()
