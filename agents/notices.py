"""Preemption notices: the cloud tells a spot node it is about to go (EC2: two
minutes before, GCP: about thirty seconds). An agent that hears one drains its
node at once: the next iteration boundary hands its stages over, the same
takeover as after a failure but without waiting for a timeout or losing work.

  EC2  IMDSv2: PUT /latest/api/token for a session token, then GET
       /latest/meta-data/spot/instance-action with it: 404 until a notice, then
       {"action": "terminate"|"stop"|"hibernate", "time": "..."}.
  GCP  GET /computeMetadata/v1/instance/preempted with `Metadata-Flavor: Google`:
       "FALSE" until the instance is preempted, then "TRUE".
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

EC2_METADATA = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"


class Ec2Notice:
    source = "ec2"

    def __init__(self, base: str = EC2_METADATA, timeout: float = 1.0):
        self.base, self.timeout = base.rstrip("/"), timeout
        self._token: str | None = None

    def _fetch_token(self) -> str:
        request = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:
            return reply.read().decode()

    def poll(self) -> dict | None:
        """The pending notice, or None."""
        if self._token is None:
            self._token = self._fetch_token()
        request = urllib.request.Request(f"{self.base}/latest/meta-data/spot/instance-action",
                                         headers={"X-aws-ec2-metadata-token": self._token})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read().decode())
        except urllib.error.HTTPError as e:
            if e.code == 401:
                self._token = None  # expired: a new one next time
            if e.code in (401, 404):
                return None
            raise


class GcpNotice:
    source = "gcp"

    def __init__(self, base: str = GCP_METADATA, timeout: float = 1.0):
        self.base, self.timeout = base.rstrip("/"), timeout

    def poll(self) -> dict | None:
        request = urllib.request.Request(f"{self.base}/computeMetadata/v1/instance/preempted",
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:
            preempted = reply.read().decode().strip().upper() == "TRUE"
        return {"action": "preempted"} if preempted else None


WATCHERS = {"ec2": Ec2Notice, "gcp": GcpNotice}


def watch(kind: str, on_notice, base: str | None = None, interval: float = 1.0) -> threading.Event:
    """Poll the metadata service of `kind` in a daemon thread; call on_notice(notice)
    once when one comes. Set the returned event to stop polling. An unreachable
    metadata service is polled again (it says nothing about preemption)."""
    notice = WATCHERS[kind](base) if base else WATCHERS[kind]()
    stop = threading.Event()

    def run():
        while not stop.wait(interval):
            try:
                found = notice.poll()
            except (OSError, ValueError):
                continue
            if found is not None:
                on_notice(dict(found, source=notice.source))
                return
    threading.Thread(target=run, daemon=True, name="notice").start()
    return stop
