"""GCP spot capacity for a job, with google-cloud-compute: an instance template
with provisioningModel=SPOT, GPUs (guest accelerators, which need
onHostMaintenance=TERMINATE) and an external IP (egress for the installs; or
leave it to Cloud NAT, see docs/cloud.md), and a regional managed instance group
spread over the chosen zones. Every instance boots into `bamboo-agent` (startup
script) with the job's etcd endpoint, its zone from the metadata server and
preemption watching, and a service account (the default, or --service-account)
with read-write Cloud Storage scope (gs:// data and checkpoints). `--etcd auto`
starts one more instance running etcd. The job's instances carry a network tag
whose firewall rules admit only each other (SSH aside).

Requests go through `_call` (printed instead of sent with `dry_run`). Credentials
come from Google's default chain (never printed); with an endpoint given (tests,
emulators) anonymous credentials are used. Long-running operations are waited on
by operations clients built here, so they use the same endpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from cloud.common import BadInput, Install, LaunchError, NodeLines, boot_script, node_exit_args

METADATA = "http://metadata.google.internal"
NETWORK = "global/networks/default"
# the nodes' credentials (the project's default service account, from the metadata
# server) may read and write Cloud Storage: gs:// data and checkpoints
STORAGE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
COMPUTE_SCOPE = "https://www.googleapis.com/auth/compute"  # the node's end: its group's size, etcd's stop
ETCD_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"   # its certificates, nothing else
ZONE_LOOKUP = """ZONE=$(curl -fsS -H 'Metadata-Flavor: Google' "$META/computeMetadata/v1/instance/zone")
ZONE=${ZONE##*/}
INSTANCE=$(curl -fsS -H 'Metadata-Flavor: Google' "$META/computeMetadata/v1/instance/id")
NAME=$(curl -fsS -H 'Metadata-Flavor: Google' "$META/computeMetadata/v1/instance/name")
NODE_REF=$ZONE/$NAME"""


# Machine types that come with their GPUs (the others take --accelerator's count):
# the node runs a worker on each (bamboo-agent --workers N).
GPUS = {"a2-highgpu-1g": 1, "a2-highgpu-2g": 2, "a2-highgpu-4g": 4, "a2-highgpu-8g": 8, "a2-megagpu-16g": 16,
        "a2-ultragpu-1g": 1, "a2-ultragpu-2g": 2, "a2-ultragpu-4g": 4, "a2-ultragpu-8g": 8, "a3-highgpu-8g": 8,
        "g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-12": 1, "g2-standard-16": 1, "g2-standard-24": 2,
        "g2-standard-32": 1, "g2-standard-48": 4, "g2-standard-96": 8}


def workers(machine_type: str, accelerator: str) -> int:
    """GPUs of one node: its machine type's own, else the accelerator count (at least one worker)."""
    found = parse_accelerator(accelerator)
    return GPUS.get(machine_type, found[1] if found else 1)


def node_gpus(machine_type: str, accelerator: str) -> int:
    """GPUs of one node (0: none)."""
    found = parse_accelerator(accelerator)
    return GPUS.get(machine_type, found[1] if found else 0)


def accelerator_for(machine_type: str, given: str | None) -> str:
    """--accelerator as the machine type needs it: none for a type that comes with
    its GPUs (a2, a3, g2), one T4 for the others, unless given."""
    if given is None:
        return "none" if machine_type in GPUS else "nvidia-tesla-t4:1"
    if machine_type in GPUS and given != "none":
        raise BadInput(f"--machine-type {machine_type} comes with {GPUS[machine_type]} GPU(s): leave out "
                       f"--accelerator {given}")
    return given


def parse_accelerator(text: str) -> tuple[str, int] | None:
    """TYPE[:COUNT] -> (type, count); 'none' -> None."""
    if text == "none":
        return None
    kind, _, count = text.partition(":")
    if not kind or not (count or "1").isdigit() or int(count or "1") < 1:
        raise BadInput(f"--accelerator {text!r}: expected TYPE[:COUNT] (nvidia-tesla-t4:1) or none")
    return kind, int(count or "1")


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
    install: Install
    machine_type: str = "n1-standard-8"
    accelerator: str = "nvidia-tesla-t4:1"  # accelerator_for's, from --machine-type
    service_account: str = "default"   # the nodes' identity: a dedicated one reaches only the job's buckets
    certs: str = ""     # the nodes' folder of etcd certificates (cloud/etcd_tls.py); none: a plain etcd
    etcd_instances: tuple[str, ...] = ()  # --etcd auto's instances (ZONE/NAME), stopped once the job is complete
    endpoint_url: str | None = None       # the API endpoint the nodes call too (tests: a local server)

    @property
    def tag(self) -> str:
        """The network tag of the job's instances, which its firewall rules name."""
        return f"bamboo-{self.job}"

    def startup_script(self) -> str:
        return boot_script(self.install, self.etcd, self.job, NodeLines(
            "gcp", METADATA, ZONE_LOOKUP, f"WORKERS={workers(self.machine_type, self.accelerator)}; "
                                          f"GPUS={node_gpus(self.machine_type, self.accelerator)}", self.certs,
            node_exit_args("gcp", self, "--project", self.project)))


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
        self.machine_types = compute_v1.MachineTypesClient(**kw)
        self.accelerator_types = compute_v1.AcceleratorTypesClient(**kw)
        self.instances = compute_v1.InstancesClient(**kw)
        self.firewalls = compute_v1.FirewallsClient(**kw)
        self.firewalls._transport._extended_operations_services["global_operations"] = \
            compute_v1.GlobalOperationsClient(**kw)
        self.instances._transport._extended_operations_services["zone_operations"] = \
            compute_v1.ZoneOperationsClient(**kw)
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

    def check(self, zones: tuple[str, ...], machine_type: str, accelerator: str) -> None:
        """The zones are in the region, the machine and GPU types in the first zone."""
        accel = parse_accelerator(accelerator)
        if self.dry_run:
            return
        region = self._call("regions", "get", project=self.project, region=self.region)
        known = {z.rsplit("/", 1)[-1] for z in region.zones}
        unknown = [z for z in zones if z not in known]
        if unknown:
            raise LaunchError(f"unknown zone(s) {', '.join(unknown)} in region {self.region} "
                              f"(it has {', '.join(sorted(known)) or 'none'})")
        self._call("machine_types", "get", project=self.project, zone=zones[0], machine_type=machine_type)
        if accel:
            self._call("accelerator_types", "get", project=self.project, zone=zones[0], accelerator_type=accel[0])

    def up(self, spec: GcpSpec) -> dict:
        from google.cloud import compute_v1 as c
        accel = parse_accelerator(spec.accelerator)
        template = c.InstanceTemplate(name=spec.name, properties=c.InstanceProperties(
            machine_type=spec.machine_type,
            disks=[c.AttachedDisk(boot=True, auto_delete=True,
                                  initialize_params=c.AttachedDiskInitializeParams(source_image=spec.image))],
            network_interfaces=[_interface()],
            guest_accelerators=[c.AcceleratorConfig(accelerator_type=accel[0], accelerator_count=accel[1])]
            if accel else [],
            scheduling=c.Scheduling(provisioning_model="SPOT", instance_termination_action="DELETE",
                                    on_host_maintenance="TERMINATE", automatic_restart=False),
            metadata=c.Metadata(items=[c.Items(key="startup-script", value=spec.startup_script())]),
            service_accounts=[c.ServiceAccount(email=spec.service_account, scopes=[STORAGE_SCOPE, COMPUTE_SCOPE])],
            tags=c.Tags(items=[spec.tag]), labels={"bamboo-job": spec.job}))
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

    def target_size(self, name: str) -> int:
        """The group's target size (its instances may not all be there yet)."""
        group = self._call("groups", "get", wait=False, project=self.project, region=self.region,
                           instance_group_manager=name)
        return int(group.target_size)

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

    # -- the job's firewall ----------------------------------------------------------------
    def job_firewall(self, spec: GcpSpec) -> list[str]:
        """Two rules on the job's network tag: its instances reach each other on
        every port (etcd, gloo, NCCL); every other source is denied all but SSH,
        above the network's own rules (default-allow-internal admits the whole
        VPC). Their names, in the order to delete them."""
        from google.cloud import compute_v1 as c
        allow, deny = f"{spec.name}-fw-job", f"{spec.name}-fw-deny"
        rules = [c.Firewall(name=allow, network=NETWORK, direction="INGRESS", priority=900,
                            source_tags=[spec.tag], target_tags=[spec.tag], allowed=[c.Allowed(I_p_protocol="all")],
                            description=f"bamboo job {spec.job}: its own instances reach each other"),
                 c.Firewall(name=deny, network=NETWORK, direction="INGRESS", priority=1000,
                            source_ranges=["0.0.0.0/0"], target_tags=[spec.tag],
                            denied=[c.Denied(I_p_protocol="tcp", ports=["0-21", "23-65535"]),
                                    c.Denied(I_p_protocol="udp")],
                            description=f"bamboo job {spec.job}: no one else, but SSH as the network allows")]
        made = []
        try:
            for rule in rules:
                self._call("firewalls", "insert", project=self.project, firewall_resource=rule)
                made.append(rule.name)
        except LaunchError:
            self.remove_firewalls(made)
            raise
        return made[::-1]

    def remove_firewalls(self, names: list[str]) -> None:
        for name in names:
            self._call("firewalls", "delete", project=self.project, firewall=name)

    # -- --etcd auto ----------------------------------------------------------------------
    def etcd_node(self, spec: GcpSpec, zone: str, script: str, member: int = 0) -> tuple[str, str]:
        """A small standard (not spot) instance running etcd member `member` (the
        first writes the job's config into it: `script`); its name and internal endpoint."""
        from google.cloud import compute_v1 as c
        name = f"{spec.name}-etcd" + (f"-{member}" if member else "")
        instance = c.Instance(
            name=name, machine_type=f"zones/{zone}/machineTypes/e2-small", network_interfaces=[_interface()],
            disks=[c.AttachedDisk(boot=True, auto_delete=True,
                                  initialize_params=c.AttachedDiskInitializeParams(source_image=spec.image))],
            metadata=c.Metadata(items=[c.Items(key="startup-script", value=script)]),
            service_accounts=[c.ServiceAccount(email=spec.service_account, scopes=[ETCD_SCOPE])],
            tags=c.Tags(items=[spec.tag]), labels={"bamboo-job": spec.job, "bamboo-role": "etcd"})
        self._call("instances", "insert", project=self.project, zone=zone, instance_resource=instance)
        if self.dry_run:
            return name, "<etcd internal ip>:2379"
        made = self._call("instances", "get", wait=False, project=self.project, zone=zone, instance=name)
        return name, f"{made.network_interfaces[0].network_i_p}:2379"

    def remove_instance(self, zone: str, name: str) -> None:
        self._call("instances", "delete", project=self.project, zone=zone, instance=name)

    def stop_instance(self, zone: str, name: str) -> None:
        self._call("instances", "stop", project=self.project, zone=zone, instance=name)

    def leave_group(self, group: str, zone: str, name: str) -> None:
        """Take instance `name` out of `group`, whose target size drops by one."""
        from google.cloud import compute_v1
        request = compute_v1.RegionInstanceGroupManagersDeleteInstancesRequest(
            instances=[f"zones/{zone}/instances/{name}"])
        self._call("groups", "delete_instances", project=self.project, region=self.region, instance_group_manager=group,
                   region_instance_group_managers_delete_instances_request_resource=request)


def _interface():
    """The default network, with an external IP: egress for pip and curl."""
    from google.cloud import compute_v1 as c
    return c.NetworkInterface(network=NETWORK,
                              access_configs=[c.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")])
