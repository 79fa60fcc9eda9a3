"""A launch's steps in order, each undone in reverse when a later one fails, so a
launch that fails half-way leaves nothing behind (the --etcd auto instance, the
uploaded wheel and the job's etcd keys included). Reads come first: the etcd is
reachable and holds no such job, the zones, subnets and machine types exist;
only then is anything created."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

from bamboo.control.config import Precision
from cloud.common import BadInput, Install, LaunchError, etcd_script
from cloud.etcd_tls import JobCertificates, member_folder
from cloud.job import JobStore, config_key, config_request
from cloud.package import build_wheel, check_package
from cloud.storage import certificates_location


class Undo:
    """What was created so far, to remove in reverse order."""

    def __init__(self):
        self.steps: list = []

    def push(self, fn) -> None:
        self.steps.append(fn)

    def run(self) -> list[str]:
        """Undo everything; the failures (each one line), for the error message."""
        failed = []
        for fn in reversed(self.steps):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 -- keep removing the rest
                failed.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.steps.clear()
        return failed


def zones_of(args) -> tuple[str, ...]:
    zones = tuple(z.strip() for z in args.zones.split(",") if z.strip())
    if args.nodes < 1 or not zones:
        raise BadInput("--nodes must be at least 1 and --zones must name a zone")
    return zones


# A GCP resource name (the template, the group, '-etcd-N' appended for etcd
# instances); an EC2 launch template's and group's name.
GCP_NAME = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")
EC2_NAME = re.compile(r"[A-Za-z0-9().\-/_]{3,128}")


def check_names(args, cloud: str) -> None:
    """The names a launch gives the provider: none empty, --name as the provider
    allows it (checked here, before any request, not by the API half-way)."""
    flags = ["region", "image"] + (["project", "machine_type"] if cloud == "gcp" else [])
    for flag in flags:
        if not getattr(args, flag).strip():
            raise BadInput(f"--{flag.replace('_', '-')} must not be empty")
    rule, what = (GCP_NAME, "1 to 52 lower-case letters, digits and '-', starting with a letter and not "
                  "ending with '-'") if cloud == "gcp" else (EC2_NAME, "3 to 128 letters, digits and ().-/_")
    if not rule.fullmatch(args.name):
        raise BadInput(f"--name {args.name!r} is not a {cloud} resource name: {what}")


def check_install(args, default_bucket: bool = False) -> None:
    """--package names where to get the code, or --bucket is where it goes (on EC2
    a bucket of the launch's own when neither is given)."""
    if args.package:
        check_package(args.package)
    elif not args.bucket and not default_bucket:
        raise BadInput("give --bucket BUCKET[/PREFIX] (where the project's wheel goes) or --package REQUIREMENT")


def installable(args, shipper, job: str, undo: Undo) -> tuple[Install, str | None]:
    """--package as given, else this project's wheel uploaded through `shipper`."""
    if args.package:
        return Install(check_package(args.package)), None
    wheel = build_wheel()
    try:
        install, uri = shipper.ship(wheel, job)
    finally:
        if getattr(shipper, "created", False):
            undo.push(shipper.delete_bucket)  # runs after the object's removal (undo is last in, first out)
    undo.push(lambda: shipper.delete(uri))
    return install, uri


def configure(args, cfg, log, undo: Undo, start_etcd, certs=None) -> tuple[str, list[str]]:
    """The job's config in its etcd: written here, or (--etcd auto) by the first
    etcd instance; `start_etcd(member, script)` creates member `member` in zone
    `member` (each later one joins those before it); `certs` (JobCertificates):
    each member's are shipped once the cloud has given it its address. The
    endpoints and those instances."""
    if args.etcd != "auto":
        store = JobStore(args.etcd, cfg.cluster.job, args.dry_run, log)
        store.write(cfg)
        undo.push(store.remove)
        return args.etcd, []
    if args.dry_run:
        log(json.dumps({**config_request("<the etcd instance>", cfg), "by": "the etcd instance's boot script"},
                       default=str))
    endpoints, instances = [], []
    for member in range(args.etcd_members):
        name = "bamboo" if args.etcd_members == 1 else f"bamboo-{zones_of(args)[member]}"
        folder = certs.folder(member_folder(member)) if certs else ""
        script = etcd_script(config_key(cfg.cluster.job), json.dumps(cfg.to_dict()), name, ",".join(endpoints), folder,
                             cfg.cluster.job, certs.install if certs else None, args.etcd_members)
        instance, endpoint = start_etcd(member, script)
        if certs:
            certs.member(member, endpoint.rpartition(":")[0])
        endpoints.append(endpoint)
        instances.append(instance)
    return ",".join(endpoints), instances


def check_members(args, zones: tuple[str, ...]) -> None:
    """--etcd-members: 1, 3, 5 or 7 instances of --etcd auto, each in a zone of its own."""
    from bamboo.control.etcd import EtcdError, check_member_count
    try:
        check_member_count(args.etcd_members)
    except EtcdError as e:
        raise BadInput(str(e)) from None
    if args.etcd_members > 1 and args.etcd != "auto":
        raise BadInput(f"--etcd-members {args.etcd_members} launches etcd instances: it needs --etcd auto "
                       "(give the members of your own etcd to --etcd instead)")
    if args.etcd_members > len(zones):
        raise BadInput(f"--etcd-members {args.etcd_members} puts each member in a zone of its own: "
                       f"--zones names only {len(zones)}")


def secured(args) -> bool:
    """Whether the launch's own etcd serves TLS with the job's certificates (the
    default of --etcd auto); --etcd-plain without --etcd auto is said to do nothing."""
    if args.etcd != "auto":
        if args.etcd_plain:
            print("bamboo-launch: note: --etcd-plain does nothing without --etcd auto (your etcd is as you run it)",
                  file=sys.stderr)
        return False
    if args.etcd_plain:
        print("bamboo-launch: warning: --etcd-plain: the job's etcd runs without TLS or auth; only its security "
              "group or firewall keeps others out", file=sys.stderr)
    return not args.etcd_plain


def job_certificates(args, tls: bool, shipper, install: Install, job: str, undo: Undo) -> JobCertificates | None:
    """The job's CA and where its certificates go (None: `tls` off); what is
    shipped is removed again if the launch fails."""
    if not tls:
        return None
    if getattr(shipper, "create", False) and not shipper.created:  # --package: no wheel made the bucket
        shipper.ensure_bucket()
        if shipper.created:
            undo.push(shipper.delete_bucket)
    certs = JobCertificates(job, certificates_location(shipper, job), shipper.put, install, args.dry_run)
    undo.push(lambda: [shipper.delete(uri) for uri in certs.shipped])
    return certs


def local_certificates(args) -> str:
    """Where the operator's copy of the job's client certificate goes: beside the
    launch record, named after it and the job (two launches from one directory, or
    two jobs in one record, keep theirs apart)."""
    return f"{os.path.splitext(os.path.abspath(args.state))[0]}-{args.job}-etcd-tls"


def ship_nodes(args, certs: JobCertificates | None, undo: Undo) -> str:
    """The nodes' folder of certificates (none without `certs`), and the operator's copy."""
    if not certs:
        return ""
    undo.push(lambda: shutil.rmtree(local_certificates(args), ignore_errors=True))
    return certs.nodes(local_certificates(args))


def check_etcd(args, job: str, log) -> None:
    """An etcd given by the user answers and holds no job of this name."""
    if args.etcd != "auto":
        store = JobStore(args.etcd, job, args.dry_run, log)
        store.check_absent()
        store.close()


def launch_ec2(args, cfg, log=print) -> dict:
    from cloud.ec2 import GPU_TYPES, GPUS, Ec2Provider, Ec2Spec
    from cloud.storage import S3Shipper, default_bucket
    zones, types = zones_of(args), tuple(args.instance_type or GPU_TYPES)
    job = cfg.cluster.job
    if cfg.recipe.precision == Precision.FP16 and (without := [t for t in types if t not in GPUS]):
        raise BadInput(f"--precision fp16 needs a GPU on each node: --instance-type {without[0]} is not a GPU type "
                       f"bamboo knows (known: {', '.join(GPUS)})")
    check_names(args, "ec2")
    check_members(args, zones)
    check_install(args, default_bucket=True)
    tls = secured(args)
    if tls and not args.iam_profile:
        raise BadInput("--etcd auto: the nodes and etcd instances read the job's etcd certificates from its bucket "
                       "with their role: give --iam-profile (a profile whose role may read the bucket), or "
                       "--etcd-plain")
    check_etcd(args, job, log)
    provider = Ec2Provider(args.region, args.endpoint_url, args.dry_run, log)
    subnets = provider.subnets(zones)
    provider.check_types(types, zones)
    undo = Undo()
    try:
        shipper = None if args.package and not tls else S3Shipper(
            args.bucket or default_bucket(job, args.region), args.region, args.endpoint_url, args.dry_run, log,
            create=not args.bucket, by_role=bool(args.iam_profile))
        install, wheel = installable(args, shipper, job, undo)
        certs = job_certificates(args, tls, shipper, install, job, undo)
        spec = Ec2Spec(name=args.name, region=args.region, zones=zones, nodes=args.nodes, image=args.image,
                       etcd=args.etcd, job=job, install=install, instance_types=types, key_name=args.key_name,
                       security_groups=tuple(args.security_group), iam_profile=args.iam_profile)
        group = provider.job_group(spec, subnets)
        undo.push(lambda: provider.remove_group(group))  # after the instances in it are gone (last in, first out)
        spec = Ec2Spec(**{**spec.__dict__, "security_groups": (group, *spec.security_groups)})

        def start_etcd(member: int, script: str) -> tuple[str, str]:
            instance, endpoint = provider.etcd_node(spec, zones[member], subnets[zones[member]], script)
            undo.push(lambda: provider.remove_instance(instance))
            return instance, endpoint
        etcd, etcd_instances = configure(args, cfg, log, undo, start_etcd, certs)
        nodes = ship_nodes(args, certs, undo)
        made = provider.up(Ec2Spec(**{**spec.__dict__, "etcd": etcd, "certs": nodes,
                                      "etcd_instances": tuple(etcd_instances), "endpoint_url": args.endpoint_url}),
                           subnets)
    except BaseException as e:
        raise _undone(e, undo) from None
    return {**made, "job": job, "etcd": etcd, **_instances(etcd_instances), "security_group": group, "wheel": wheel,
            "wheel_bucket_created": bool(shipper and shipper.created), "endpoint_url": args.endpoint_url,
            **_certificates(args, certs)}


def launch_gcp(args, cfg, log=print) -> dict:
    from cloud.gcp import GcpProvider, GcpSpec, accelerator_for, node_gpus
    from cloud.storage import GcsShipper
    zones = zones_of(args)
    job = cfg.cluster.job
    check_names(args, "gcp")
    args.accelerator = accelerator_for(args.machine_type, args.accelerator)
    if cfg.recipe.precision == Precision.FP16 and not node_gpus(args.machine_type, args.accelerator):
        raise BadInput(f"--precision fp16 needs a GPU on each node: --machine-type {args.machine_type} with "
                       f"--accelerator none has none")
    check_members(args, zones)
    check_install(args)
    tls = secured(args)
    if tls and not args.bucket:
        raise BadInput("--etcd auto keeps the job's etcd certificates in its bucket, where the nodes and etcd "
                       "instances read them with their service account: give --bucket, or --etcd-plain")
    check_etcd(args, job, log)
    provider = GcpProvider(args.project, args.region, args.endpoint_url, args.dry_run, log)
    provider.check(zones, args.machine_type, args.accelerator)
    undo = Undo()
    try:
        shipper = None if args.package and not tls else GcsShipper(
            args.bucket, args.project, args.storage_endpoint_url, args.dry_run, log)
        install, wheel = installable(args, shipper, job, undo)
        certs = job_certificates(args, tls, shipper, install, job, undo)
        spec = GcpSpec(name=args.name, project=args.project, region=args.region, zones=zones, nodes=args.nodes,
                       image=args.image, etcd=args.etcd, job=job, install=install,
                       machine_type=args.machine_type, accelerator=args.accelerator,
                       service_account=args.service_account)
        firewalls = provider.job_firewall(spec)
        undo.push(lambda: provider.remove_firewalls(firewalls))

        def start_etcd(member: int, script: str) -> tuple[str, str]:
            zone = zones[member]
            instance, endpoint = provider.etcd_node(spec, zone, script, member)
            undo.push(lambda: provider.remove_instance(zone, instance))
            return f"{zone}/{instance}", endpoint
        etcd, etcd_instances = configure(args, cfg, log, undo, start_etcd, certs)
        nodes = ship_nodes(args, certs, undo)
        made = provider.up(GcpSpec(**{**spec.__dict__, "etcd": etcd, "certs": nodes,
                                      "etcd_instances": tuple(etcd_instances), "endpoint_url": args.endpoint_url}))
    except BaseException as e:
        raise _undone(e, undo) from None
    from cloud.planning import gcp_row
    return {**made, "project": args.project, "priced_as": gcp_row(args), "job": job, "etcd": etcd,
            **_instances(etcd_instances),
            "firewalls": firewalls, "wheel": wheel, "endpoint_url": args.endpoint_url,
            "storage_endpoint_url": args.storage_endpoint_url, **_certificates(args, certs)}


def _certificates(args, certs: JobCertificates | None) -> dict:
    """The launch record's certificates: the objects shipped (down removes them)
    and the operator's client certificate folder (bamboo-status --etcd-tls)."""
    if not certs:
        return {"certificates": [], "etcd_tls": None}
    return {"certificates": certs.shipped, "etcd_tls": local_certificates(args)}


def _instances(etcd_instances: list[str]) -> dict:
    """The launch record's etcd instances: the first as `etcd_instance` (what a
    launch of one recorded), all as `etcd_instances`."""
    return {"etcd_instance": etcd_instances[0] if etcd_instances else None, "etcd_instances": etcd_instances}


def _undone(error: BaseException, undo: Undo) -> BaseException:
    """`error`, after undoing what the launch created; a failed undo is named in it."""
    left = undo.run()
    if not isinstance(error, LaunchError):
        return error
    if left:
        return LaunchError(f"{error}; and removing what was created failed: {'; '.join(left)}")
    return error
