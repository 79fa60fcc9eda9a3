"""The GPU instance types the planner and the cost estimate know: what each GPU
and the host hold, and what an hour costs.

Memory is what the driver reports as the GPU's total (nvidia-smi) and the
instance's RAM. Prices are on-demand list prices in US dollars per instance-hour
(EC2 us-east-1 Linux, Compute Engine us-central1), as published in 2025; spot
prices move by the hour, so `spot` is a typical spot price of that year, not a
quote. A JSON file given with `--prices` replaces any of them
(`{"g5.xlarge": {"on_demand": 1.006, "spot": 0.45}}`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

GIB = 1 << 30


@dataclass(frozen=True)
class Instance:
    name: str
    gpu: str
    gpus: int           # GPUs per instance: its agent runs a worker on each
    gpu_gib: float      # each GPU's memory
    host_gib: float     # the instance's RAM, shared by its workers
    on_demand: float    # $ per instance-hour
    spot: float         # $ per instance-hour, typical

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gib * GIB)

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * GIB)


def _table(*rows) -> dict[str, Instance]:
    return {row[0]: Instance(*row) for row in rows}


INSTANCES = _table(
    # EC2
    ("g4dn.xlarge", "T4", 1, 15.0, 16, 0.526, 0.22),
    ("g4dn.2xlarge", "T4", 1, 15.0, 32, 0.752, 0.30),
    ("g4dn.4xlarge", "T4", 1, 15.0, 64, 1.204, 0.48),
    ("g4dn.12xlarge", "T4", 4, 15.0, 192, 3.912, 1.60),
    ("g5.xlarge", "A10G", 1, 22.5, 16, 1.006, 0.45),
    ("g5.2xlarge", "A10G", 1, 22.5, 32, 1.212, 0.50),
    ("g5.4xlarge", "A10G", 1, 22.5, 64, 1.624, 0.68),
    ("g5.12xlarge", "A10G", 4, 22.5, 192, 5.672, 2.30),
    ("g6.xlarge", "L4", 1, 22.5, 16, 0.805, 0.38),
    ("g6.2xlarge", "L4", 1, 22.5, 32, 0.978, 0.45),
    ("p3.2xlarge", "V100", 1, 15.8, 61, 3.06, 0.92),
    ("p3.8xlarge", "V100", 4, 15.8, 244, 12.24, 3.67),
    ("p4d.24xlarge", "A100", 8, 40.0, 1152, 32.77, 12.0),
    # Compute Engine (n1 with a T4 attached: the pair's price)
    ("n1-standard-8+t4", "T4", 1, 15.0, 30, 0.73, 0.25),
    ("g2-standard-4", "L4", 1, 22.5, 16, 0.707, 0.28),
    ("g2-standard-8", "L4", 1, 22.5, 32, 0.854, 0.34),
    ("a2-highgpu-1g", "A100", 1, 40.0, 85, 3.673, 1.47),
    ("a2-ultragpu-1g", "A100-80GB", 1, 80.0, 170, 5.069, 2.03),
)


# Each GPU's dense peak, TFLOP/s: (tensor cores at 16 bits, plain fp32), from
# NVIDIA's data sheets (the A10G taken as the A10 it is built from). The cost
# estimate runs a GPU at `sim.profiles.GPU_UTILISATION` of it.
GPU_TFLOPS = {"T4": (65.0, 8.1), "A10G": (125.0, 31.2), "L4": (121.0, 30.3), "V100": (125.0, 15.7),
              "A100": (312.0, 19.5), "A100-80GB": (312.0, 19.5)}


def gpu_flops(kind: Instance, half: bool) -> float:
    """Peak FLOP/s of one of `kind`'s GPUs: with 16-bit autocast (`half`) or in fp32."""
    return GPU_TFLOPS[kind.gpu][0 if half else 1] * 1e12


def per_gpu_prices(kinds: list[Instance]) -> tuple[float, float]:
    """(spot, on-demand) dollars per GPU-hour, the mean over `kinds`: a node of the
    runtime (and of the simulator) is one GPU's worker."""
    return (sum(k.spot / k.gpus for k in kinds) / len(kinds), sum(k.on_demand / k.gpus for k in kinds) / len(kinds))


class InstanceError(ValueError):
    """An instance type or a price file that cannot be used."""


def instance(name: str, table: dict[str, Instance] = INSTANCES) -> Instance:
    if name not in table:
        raise InstanceError(f"instance type {name!r} is not in the table (known: {', '.join(table)}); "
                            "give --gpu-memory instead")
    return table[name]


def with_prices(path: str, table: dict[str, Instance] = INSTANCES) -> dict[str, Instance]:
    """`table` with the prices of a JSON file: type -> {"on_demand": $/h, "spot": $/h}."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise InstanceError(f"--prices {path}: {e}") from None
    if not isinstance(raw, dict):
        raise InstanceError(f"--prices {path}: expected an object of instance types")
    out = dict(table)
    for name, prices in raw.items():
        if name not in table or not isinstance(prices, dict) or not set(prices) <= {"on_demand", "spot"}:
            raise InstanceError(f"--prices {path}: {name!r}: expected a known type with on_demand and/or spot")
        for key, value in prices.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1000:
                raise InstanceError(f"--prices {path}: {name}.{key} must be dollars per hour, above 0 (got {value!r})")
        out[name] = replace(table[name], **{k: float(v) for k, v in prices.items()})
    return out
