"""What `bamboo-launch status|scale|down` do with a recorded launch: the
instances beside the job's progress in its etcd; the group resized; everything
the launch created removed (group, template, --etcd auto instance, the uploaded
wheel, the job's etcd keys), the part that is already gone skipped."""
from __future__ import annotations

from agents.cloud.common import LaunchError


def provider_for(state: dict, dry_run: bool = False):
    if state["provider"] == "ec2":
        from agents.cloud.ec2 import Ec2Provider
        return Ec2Provider(state["region"], state.get("endpoint_url"), dry_run)
    from agents.cloud.gcp import GcpProvider
    return GcpProvider(state["project"], state["region"], state.get("endpoint_url"), dry_run)


def shipper_for(state: dict):
    if state["provider"] == "ec2":
        from agents.cloud.storage import S3Shipper
        return S3Shipper(state["wheel"], state["region"], state.get("endpoint_url"), False)
    from agents.cloud.storage import GcsShipper
    return GcsShipper(state["wheel"], state["project"], state.get("storage_endpoint_url"), False)


def job_progress(state: dict) -> dict:
    """bamboo-status's view of the job, or why it cannot be read from here."""
    from bamboo.commands.status import job_status
    from bamboo.control.etcd import EtcdError
    try:
        return job_status(state["etcd"], state["job"])
    except EtcdError as e:
        return {"job": state["job"], "error": str(e)}


def status(state: dict) -> dict:
    return {**state, "instances": provider_for(state).describe(state["name"]), "progress": job_progress(state)}


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
    if state.get("wheel"):
        shipper = shipper_for(state)
        shipper.delete(state["wheel"])
        if state.get("wheel_bucket_created"):
            shipper.delete_bucket()  # the launch's own bucket (no --bucket was given)
    if state.get("job") and not state.get("etcd_instance"):
        from agents.cloud.job import JobStore
        try:
            store = JobStore(state["etcd"], state["job"])
        except LaunchError:
            return  # unreachable from here: its keys stay (and do no harm)
        store.remove()
        store.close()
