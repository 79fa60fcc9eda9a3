"""Which device a worker computes on, and how its messages travel.

A host runs one or more workers (a cloud node runs one; `--local-nodes N` runs N
on this machine). Each is told its index among the host's workers in
`LOCAL_RANK`, as torch elastic does, and takes the GPU of that index: from all
the host's GPUs, or from the list `--devices` gives. More workers than GPUs is
an error unless `--share-gpu` asks for it (several workers on one card: what
the GPU tests run). Messages go over gloo, or with `--transport nccl` (workers
with a GPU each) over NCCL (bamboo/transport/channels.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bamboo.control.config import Transport

LOCAL_RANK = "LOCAL_RANK"  # the worker's index among this host's workers (torch elastic's name)


class DeviceError(ValueError):
    """The workers cannot be placed on this host's devices as asked."""


def parse_devices(text: str | None) -> tuple[str, ...]:
    """`--devices`: comma-separated GPU indices, or `cpu` (no GPU even if there is one)."""
    if not text:
        return ()
    items = tuple(x.strip() for x in text.split(","))
    if items == ("cpu",):
        return items
    if not all(x.isdigit() for x in items):
        raise DeviceError(f"--devices takes GPU indices like 0,1,3 or 'cpu' (got {text!r})")
    if len(set(items)) != len(items):
        raise DeviceError(f"--devices names a GPU twice ({text!r})")
    return items


def local_rank() -> int:
    """This worker's index among its host's workers (0 when nobody said)."""
    value = os.environ.get(LOCAL_RANK, "0")
    if not value.isdigit():
        raise DeviceError(f"{LOCAL_RANK} must be a worker index, not {value!r}")
    return int(value)


def pick(rank: int, devices: tuple[str, ...], gpus: int, share: bool) -> torch.device:
    """The device of the host's worker number `rank`, given the host's GPU count."""
    if devices == ("cpu",) or (gpus == 0 and not devices):
        return torch.device("cpu")
    indices = [int(d) for d in devices] if devices else list(range(gpus))
    if missing := [i for i in indices if i >= gpus]:
        raise DeviceError(f"--devices names GPU {missing[0]}, but this host has {gpus} GPU(s)")
    if rank >= len(indices) and not share:
        raise DeviceError(f"worker {rank} of this host has no GPU of its own ({len(indices)} for its workers): "
                          "run fewer workers per host, or give --share-gpu to put several on one GPU")
    return torch.device("cuda", indices[rank % len(indices)])


def transport(requested: str, device: torch.device, share: bool) -> str:
    """The transport of this worker's messages. NCCL (bamboo/transport/channels.py: payloads
    and the data-parallel reduce) needs every worker on a GPU of its own. `auto` is
    gloo, GPU tensors staged through pinned host buffers (bamboo/transport/staging.py), until
    the NCCL path has passed `make gpu-check` on a machine with two GPUs."""
    if requested != Transport.NCCL:
        return Transport.GLOO
    if device.type != "cuda":
        raise DeviceError("--transport nccl needs a GPU for every worker, and this worker has none")
    if share:
        raise DeviceError("--transport nccl cannot share a GPU between workers (NCCL refuses two ranks "
                          "on one device): drop --share-gpu or use --transport gloo")
    if not dist.is_nccl_available():
        raise DeviceError("--transport nccl: this torch build has no NCCL: use --transport gloo")
    return Transport.NCCL


def host_gpus() -> int:
    """This host's GPU count (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def claim(rank: int, devices: tuple[str, ...], share: bool) -> torch.device:
    """The device of this host's worker number `rank` (`pick`), made the process's
    current GPU when it is one: kernels, streams and NCCL default to it."""
    device = pick(rank, devices, host_gpus(), share)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def check_flags(devices: str | None, share: bool, requested: str, workers_here: int) -> tuple[str, ...]:
    """The launcher's check, before anything starts, of the flags against this host."""
    parsed, gpus = parse_devices(devices), host_gpus()
    for rank in range(max(1, workers_here)):
        transport(requested, pick(rank, parsed, gpus, share), share)
    return parsed


def share_note(devices: str | None, workers_here: int) -> str | None:
    """Why --share-gpu does nothing on this host for `workers_here` workers (no GPU,
    or one for each), or None when some of them do share one."""
    parsed, gpus = parse_devices(devices), host_gpus()
    if parsed == ("cpu",) or gpus == 0:
        return "the workers compute on the CPU" + (" (--devices cpu)" if parsed == ("cpu",) else
                                                    ": this host has no GPU")
    usable = len(parsed) if parsed else gpus
    if workers_here <= usable:
        return f"{workers_here} worker(s) on this host and {usable} GPU(s) for them: each has its own"
    return None


def add_flags(parser) -> None:
    """The device flags of bamboo-train (and of a cloud launch, for its nodes)."""
    parser.add_argument("--devices", metavar="I,J,...|cpu",
                        help="the GPUs this host's workers take, one each in order (default: all; cpu: none)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="let several workers share one GPU when there are more workers than GPUs")
    parser.add_argument("--transport", choices=Transport.values(), default="auto",
                        help="messages between workers: gloo, or nccl (a GPU per worker; not yet run on a "
                             "GPU); auto: gloo")
