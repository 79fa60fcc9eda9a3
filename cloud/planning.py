"""`bamboo-launch ec2|gcp ... --plan`: the job's plan (commands/train/plan.py)
against the GPUs and host memory of the instances its group may get, before any
request is sent; and which row of the instance table a GCP launch's nodes are
(their prices, for --estimate and the dashboard)."""
from __future__ import annotations

from dataclasses import replace

from cloud import ec2, gcp
from cloud.common import BadInput
from commands.train.instances import GIB, INSTANCES, InstanceError, instance
from commands.train.plan import Target

# GPUs Compute Engine attaches to an N1 machine: (name, GiB each)
ACCELERATORS = {"nvidia-tesla-t4": ("T4", 15.0), "nvidia-l4": ("L4", 22.5), "nvidia-tesla-v100": ("V100", 15.8),
                "nvidia-tesla-p100": ("P100", 16.0), "nvidia-tesla-a100": ("A100", 40.0),
                "nvidia-a100-80gb": ("A100-80GB", 80.0)}
N1_GIB_PER_VCPU = {"n1-standard": 3.75, "n1-highmem": 6.5, "n1-highcpu": 0.9}


def target(args, gpu_gib: float | None = None, host_gib: float | None = None) -> Target:
    """The smallest GPU, and the least host memory per GPU, among the types the group
    may get; `gpu_gib` and `host_gib` (--gpu-memory, --host-memory) replace what they give."""
    try:
        found = _ec2(args) if args.command == "ec2" else _gcp(args)
    except InstanceError as e:
        if gpu_gib is None:
            raise BadInput(f"--plan: {e}") from None
        found = Target("the group's instances", None, None, 1)  # a type the table does not know: the sizes given
    if gpu_gib is not None:
        found = replace(found, name=f"{gpu_gib:g} GiB GPUs", gpu_bytes=int(gpu_gib * GIB))
    if host_gib is not None:
        found = replace(found, host_bytes=int(host_gib * GIB))
    return found


def _ec2(args) -> Target:
    kinds = [instance(t) for t in (args.instance_type or ec2.GPU_TYPES)]
    names = ", ".join(k.name for k in kinds)
    return Target(names if len(kinds) == 1 else f"the smallest of {names}", min(k.gpu_bytes for k in kinds),
                  min(k.host_bytes // k.gpus for k in kinds), 1)


def _gcp(args) -> Target:
    machine = args.machine_type
    if machine in INSTANCES:
        kind = INSTANCES[machine]
        return Target(f"{machine} ({kind.gpu})", kind.gpu_bytes, kind.host_bytes, kind.gpus)
    found = gcp.parse_accelerator(gcp.accelerator_for(machine, args.accelerator))
    if not found or found[0] not in ACCELERATORS:
        raise InstanceError(f"the GPU of --machine-type {machine} with --accelerator {args.accelerator} is not "
                            f"known to the planner (known: {', '.join(ACCELERATORS)}); give --gpu-memory")
    gpu, gib = ACCELERATORS[found[0]]
    family, _, vcpus = machine.rpartition("-")
    host = int(N1_GIB_PER_VCPU[family] * int(vcpus) * GIB) if family in N1_GIB_PER_VCPU and vcpus.isdigit() else None
    return Target(f"{machine} with {found[1]} {gpu}", int(gib * GIB), host, found[1])


def gcp_row(args) -> str:
    """The instance table's row of a GCP launch's nodes: their machine type, or an N1
    machine with a T4 attached (the one pairing priced); else a name it has not."""
    if args.machine_type in INSTANCES:
        return args.machine_type
    found = gcp.parse_accelerator(gcp.accelerator_for(args.machine_type, args.accelerator))
    if args.machine_type == "n1-standard-8" and found and found == ("nvidia-tesla-t4", 1):
        return "n1-standard-8+t4"
    return f"{args.machine_type} with {args.accelerator}"
