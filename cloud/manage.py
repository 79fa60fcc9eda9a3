"""What `bamboo-launch status|scale|down` do with a recorded launch: the
instances beside the job's progress in its etcd, read through a tunnel where it
must be (cloud/watch.py), and the command that opens its dashboard; the group
resized; everything the launch created removed (group, template, --etcd auto
instance, the uploaded wheel and etcd certificates, the job's etcd keys), the
part that is already gone skipped."""
from __future__ import annotations

import shlex
import shutil

from cloud.common import LaunchError

DEFAULT_STATE = ".bamboo-launch.json"  # bamboo-launch --state's default


def provider_for(state: dict, dry_run: bool = False):
    if state["provider"] == "ec2":
        from cloud.ec2 import Ec2Provider
        return Ec2Provider(state["region"], state.get("endpoint_url"), dry_run)
    from cloud.gcp import GcpProvider
    return GcpProvider(state["project"], state["region"], state.get("endpoint_url"), dry_run)


def shipper_for(state: dict, location: str):
    """The storage client of the launch's bucket that holds `location`."""
    if state["provider"] == "ec2":
        from cloud.storage import S3Shipper
        return S3Shipper(location, state["region"], state.get("endpoint_url"), False)
    from cloud.storage import GcsShipper
    return GcsShipper(location, state["project"], state.get("storage_endpoint_url"), False)


def job_progress(state: dict) -> dict:
    """bamboo-status's view of the job, or why it cannot be read from here."""
    from commands.status.status import job_status
    from bamboo.control.credentials import ClientFiles, CredentialError
    from bamboo.control.etcd import FROM_ENV, EtcdError
    try:
        tls = ClientFiles.in_dir(state["etcd_tls"]) if state.get("etcd_tls") else FROM_ENV
        return job_status(state["etcd"], state["job"], tls)
    except CredentialError as e:
        return {"job": state["job"], "error": str(e)}
    except EtcdError as e:
        return {"job": state["job"], "error": str(e)}


def status(state: dict, tunnel=None) -> dict:
    """The record, the group's instances and the job's progress, read through
    `tunnel` (cloud/watch.py; by default the way `auto` chooses)."""
    from cloud.watch import DIRECT_HINT, Tunnel
    tunnel = tunnel or Tunnel(state)
    try:
        with tunnel as endpoint:
            progress = job_progress({**state, "etcd": endpoint})
    except LaunchError as e:
        progress = {"job": state["job"], "error": str(e)}
    if "error" in progress and tunnel.chosen == "direct":
        progress["error"] += DIRECT_HINT
    return {**state, "instances": provider_for(state).describe(state["name"]), "progress": progress,
            "dashboard": watch_command(state)}


def watch_command(state: dict, records: str = DEFAULT_STATE) -> str:
    """The command that opens the job's live dashboard from this machine (`records`:
    the launch record's file)."""
    where = f"--state {shlex.quote(records)} " if records != DEFAULT_STATE else ""
    return f"bamboo-launch {where}dashboard {shlex.quote(state['job'])}"


def scale(state: dict, nodes: int) -> None:
    if nodes < 0:
        raise LaunchError(f"scale to {nodes} nodes: expected 0 or more")
    provider_for(state).scale(state["name"], nodes)


def down(state: dict) -> None:
    provider = provider_for(state)
    provider.down(state["name"])
    for instance in state.get("etcd_instances") or ([state["etcd_instance"]] if state.get("etcd_instance") else []):
        if state["provider"] == "ec2":
            provider.remove_instance(instance)
        else:
            zone, _, name = instance.partition("/")
            provider.remove_instance(zone, name)
    if state.get("security_group"):  # once its instances are gone (EC2 refuses a group in use)
        provider.remove_group(state["security_group"])
    if state.get("firewalls"):
        provider.remove_firewalls(state["firewalls"])
    stored = [*(state.get("certificates") or []), *([state["wheel"]] if state.get("wheel") else [])]
    shipper = shipper_for(state, stored[0]) if stored else None  # all in the launch's one bucket
    for uri in stored:
        shipper.delete(uri)
    if shipper and state.get("wheel_bucket_created"):
        shipper.delete_bucket()  # the launch's own bucket (no --bucket was given)
    if state.get("etcd_tls"):
        shutil.rmtree(state["etcd_tls"], ignore_errors=True)
    if state.get("job") and not state.get("etcd_instance"):
        from cloud.job import JobStore
        try:
            store = JobStore(state["etcd"], state["job"])
        except LaunchError:
            return  # unreachable from here: its keys stay (and do no harm)
        store.remove()
        store.close()
