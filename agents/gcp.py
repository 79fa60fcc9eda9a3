"""GCP spot capacity for a job, with google-cloud-compute: an instance template
with provisioningModel=SPOT and a regional managed instance group spread over the
chosen zones. Every instance boots into `bamboo-agent` (startup script) with the
job's etcd endpoint, its zone from the metadata server and preemption watching.

Requests go through `_call` (printed instead of sent with `dry_run`). Credentials
come from Google's default chain (never printed); with an endpoint given (tests,
emulators) anonymous credentials are used. Long-running operations are waited on
by operations clients built here, so they use the same endpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from agents.cloud import DISTRIBUTION, LaunchError, boot_script

ZONE_LOOKUP = """ZONE=$(curl -s -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/zone)
ZONE=${ZONE##*/}"""


@dataclass(frozen=True)
class GcpSpec:
    name: str
    project: str
    region: str
    zones: tuple[str, ...]
    nodes: int
    image: str
    etcd: str
    job: str
    machine_type: str = "n1-standard-8"
    package: str = DISTRIBUTION

    def startup_script(self) -> str:
        return boot_script(self.package, self.etcd, self.job, "gcp", ZONE_LOOKUP)


class GcpProvider:
    def __init__(self, project: str, region: str, endpoint_url: str | None = None, dry_run: bool = False,
                 log=print):
        self.project, self.region, self.dry_run, self.log = project, region, dry_run, log
        if dry_run:
            return
        from google.cloud import compute_v1
        options = {"api_endpoint": endpoint_url} if endpoint_url else None
        credentials = None
        if endpoint_url:
            from google.auth.credentials import AnonymousCredentials
            credentials = AnonymousCredentials()
        else:
            import google.auth
            from google.auth.exceptions import DefaultCredentialsError
            try:
                credentials, _ = google.auth.default()
            except DefaultCredentialsError:
                raise LaunchError("no Google credentials (the default chain: GOOGLE_APPLICATION_CREDENTIALS, "
                                  "gcloud, the metadata server)") from None
        kw = {"credentials": credentials, "client_options": options, "transport": "rest"}
        self.templates = compute_v1.InstanceTemplatesClient(**kw)
        self.groups = compute_v1.RegionInstanceGroupManagersClient(**kw)
        self.regions = compute_v1.RegionsClient(**kw)
        # Operation polling builds its own clients: build them here, on our endpoint.
        self.templates._transport._extended_operations_services["global_operations"] = \
            compute_v1.GlobalOperationsClient(**kw)
        self.groups._transport._extended_operations_services["region_operations"] = \
            compute_v1.RegionOperationsClient(**kw)

    def _call(self, client: str, method: str, wait: bool = True, **request):
        if self.dry_run:
            shown = {k: (type(v).to_dict(v) if hasattr(type(v), "to_dict") else v) for k, v in request.items()}
            self.log(json.dumps({"service": client, "method": method, "request": shown}, default=str))
            return None
        from google.api_core.exceptions import GoogleAPICallError
        try:
            result = getattr(getattr(self, client), method)(**request)
            if wait and hasattr(result, "result"):
                result.result(timeout=600)
            return result
        except GoogleAPICallError as e:
            raise LaunchError(f"GCP refused {method} on {client}: {e.message or e}") from None

    def up(self, spec: GcpSpec) -> dict:
        from google.cloud import compute_v1 as c
        if not self.dry_run:
            region = self._call("regions", "get", project=self.project, region=self.region)
            known = {z.rsplit("/", 1)[-1] for z in region.zones}
            unknown = [z for z in spec.zones if z not in known]
            if unknown:
                raise LaunchError(f"unknown zone(s) {', '.join(unknown)} in region {self.region} "
                                  f"(it has {', '.join(sorted(known)) or 'none'})")
        template = c.InstanceTemplate(name=spec.name, properties=c.InstanceProperties(
            machine_type=spec.machine_type,
            disks=[c.AttachedDisk(boot=True, auto_delete=True,
                                  initialize_params=c.AttachedDiskInitializeParams(source_image=spec.image))],
            network_interfaces=[c.NetworkInterface(network="global/networks/default")],
            scheduling=c.Scheduling(provisioning_model="SPOT", instance_termination_action="DELETE"),
            metadata=c.Metadata(items=[c.Items(key="startup-script", value=spec.startup_script())]),
            labels={"bamboo-job": spec.job}))
        self._call("templates", "insert", project=self.project, instance_template_resource=template)
        group = c.InstanceGroupManager(
            name=spec.name, base_instance_name=spec.name, target_size=spec.nodes,
            instance_template=f"projects/{self.project}/global/instanceTemplates/{spec.name}",
            distribution_policy=c.DistributionPolicy(zones=[
                c.DistributionPolicyZoneConfiguration(zone=f"zones/{z}") for z in spec.zones]))
        try:
            self._call("groups", "insert", project=self.project, region=self.region,
                       instance_group_manager_resource=group)
        except LaunchError:
            self._call("templates", "delete", project=self.project, instance_template=spec.name)
            raise
        return {"provider": "gcp", "name": spec.name, "region": self.region, "zones": list(spec.zones),
                "nodes": spec.nodes}

    def scale(self, name: str, nodes: int) -> None:
        self._call("groups", "resize", project=self.project, region=self.region, instance_group_manager=name,
                   size=nodes)

    def describe(self, name: str) -> list[dict]:
        pages = self._call("groups", "list_managed_instances", wait=False, project=self.project,
                           region=self.region, instance_group_manager=name)
        out = []
        for m in pages or []:
            parts = m.instance.split("/")
            out.append({"id": parts[-1], "zone": parts[parts.index("zones") + 1] if "zones" in parts else None,
                        "status": m.instance_status, "action": m.current_action})
        return out

    def down(self, name: str) -> None:
        self._call("groups", "delete", project=self.project, region=self.region, instance_group_manager=name)
        self._call("templates", "delete", project=self.project, instance_template=name)
