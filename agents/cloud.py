"""What every cloud provider shares: the one-line launch error, and the script a
new node boots with (install Bamboo, find the node's zone, run its agent)."""
from __future__ import annotations


# The project's distribution name on the package index (import packages: bamboo,
# schedules, agents, sim). "bamboo" there is an unrelated project.
DISTRIBUTION = "bamboo-spot"


class LaunchError(RuntimeError):
    """A launch request the cloud refused, or bad input; one line."""


BOOT = """#!/bin/bash
# Installs Bamboo and runs this node's agent (written by bamboo-launch).
set -euo pipefail
python3 -m venv /opt/bamboo
/opt/bamboo/bin/pip install --quiet torch==2.13.0 '{package}'
{zone_lookup}
exec /opt/bamboo/bin/bamboo-agent --etcd {etcd} --job {job} --zone "$ZONE" --notice {notice}
"""


def boot_script(package: str, etcd: str, job: str, notice: str, zone_lookup: str) -> str:
    """`zone_lookup`: shell lines that set ZONE from the cloud's metadata service."""
    return BOOT.format(package=package, etcd=etcd, job=job, notice=notice, zone_lookup=zone_lookup)
