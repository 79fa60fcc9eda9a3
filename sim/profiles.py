"""Model profiles for the cluster simulator: per-stage forward/backward time, what
a message, a swap and a layer handover cost, and how much memory a stage needs.

Two sources, and `Profile.sources` says which number comes from which:

- arithmetic: one layer's forward pass costs 24*b*s*h^2 + 4*b*s^2*h floating-point
  operations (b sequences of s tokens, hidden size h), its backward twice that, at
  the GPU rate below; FRC intermediates swapped to host memory are about 34*b*s*h
  bytes per layer; an optimizer step is 1 ms per stage.
- calibrated: forward, backward and AdamW step of one layer of the same shape
  timed on this machine's CPU with the runtime's own layers, optimizer and swap
  (`scripts/calibrate_sim.py`, `sim/calibration.json`), then scaled to the GPU: the
  compute by the ratio of the CPU's measured matrix-product rate to the GPU rate,
  the step (memory-bound) by the ratio of the CPU's measured copy bandwidth to the
  GPU's memory bandwidth; the swap moves the bytes `SavedTensors` really kept,
  halved for fp16.

Stated GPU (EC2 p3.2xlarge, one V100): 125 TFLOP/s fp16 peak, 30% of it sustained
in training; 900 GB/s memory at 80%. Network between nodes 1 GB/s (10 Gbit/s
nominal); PCIe 10 GB/s. Either way messages, all-reduce and handovers are
arithmetic. A layer has 12*h^2 parameters; a stage's state is 16 bytes per
parameter (mixed-precision AdamW: fp16 weights and gradients, fp32 master
weights and two moments), what a handover or a peer reload moves. A profile
measured by `bamboo-train` (its iteration times) can replace both.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from schedules.cost import CostModel

GPU_PEAK_FLOPS = 125e12            # V100 fp16 tensor-core peak
GPU_UTILISATION = 0.30             # sustained share of the peak in training
TFLOPS = GPU_PEAK_FLOPS * GPU_UTILISATION
GPU_MEMORY_BANDWIDTH = 900e9 * 0.8  # V100 HBM2, 80% reached by a fused optimizer step
NETWORK = 1e9                      # bytes/s between nodes
PCIE = 10e9                        # bytes/s host <-> device
STATE_BYTES_PER_PARAM = 16         # handover, peer reload
FP16_OVER_FP32 = 0.5               # the calibration runs in fp32; the GPU keeps fp16 intermediates
CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")


@dataclass(frozen=True)
class Calibration:
    """One layer's per-microbatch times measured on a CPU and the two references
    (matrix-product FLOP/s, copy bytes/s) that put them on the GPU's scale."""
    forward_ms: float
    backward_ms: float
    step_ms: float
    swap_bytes: float
    gemm_flops: float
    copy_bytes_per_s: float

    @property
    def flop_ratio(self) -> float:
        return self.gemm_flops / TFLOPS

    @property
    def bandwidth_ratio(self) -> float:
        return self.copy_bytes_per_s / GPU_MEMORY_BANDWIDTH

    def describe(self) -> dict:
        return {"cpu_forward_ms": round(self.forward_ms, 2), "cpu_backward_ms": round(self.backward_ms, 2),
                "cpu_step_ms": round(self.step_ms, 2), "cpu_swap_bytes": round(self.swap_bytes),
                "cpu_gemm_flops": round(self.gemm_flops), "cpu_copy_bytes_per_s": round(self.copy_bytes_per_s),
                "flop_ratio": round(self.flop_ratio, 6), "bandwidth_ratio": round(self.bandwidth_ratio, 6)}


def load_calibration(name: str, path: str = CALIBRATION) -> Calibration | None:
    """The measured layer of profile `name`, or None when the file has none."""
    try:
        with open(path) as f:
            data = json.load(f)
        layer, ref = data["layers"][name], data["reference"]
    except (OSError, KeyError, ValueError):
        return None
    return Calibration(layer["forward_ms"], layer["backward_ms"], layer["step_ms"], layer["swap_bytes"],
                       ref["gemm_flops"], ref["copy_bytes_per_s"])


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    hidden: int
    seq: int
    microbatch: int        # sequences per microbatch
    microbatches: int      # global microbatches per iteration (split over pipelines)
    calibration: Calibration | None = None
    params: float = 0.0    # a user's model: its parameters (0: 12 h^2 a layer)
    blocks: int = 0        # ... and its attention blocks (0: every layer is one)
    gpu_flops: float = TFLOPS  # sustained FLOP/s of the GPU (arithmetic)

    @property
    def layer_forward_ms(self) -> float:
        """2 FLOPs per parameter and token, and attention's 4 b s^2 h per block."""
        c = self.calibration
        if c:
            return c.forward_ms * c.flop_ratio
        b, s, h = self.microbatch, self.seq, self.hidden
        attention = 4 * b * s * s * h * (self.blocks or self.layers) / self.layers
        return (2 * b * s * self.layer_params + attention) / self.gpu_flops * 1e3

    @property
    def layer_params(self) -> float:
        return self.params / self.layers if self.params else 12 * self.hidden * self.hidden

    def stage_layers(self, depth: int) -> float:
        return self.layers / depth

    def _layer_costs(self) -> tuple[float, float, float, float]:
        """One layer's forward, backward and step (ms) and swapped bytes."""
        c = self.calibration
        if c:
            return (self.layer_forward_ms, c.backward_ms * c.flop_ratio, c.step_ms * c.bandwidth_ratio,
                    c.swap_bytes * FP16_OVER_FP32)
        b, s, h = self.microbatch, self.seq, self.hidden
        return self.layer_forward_ms, 2 * self.layer_forward_ms, 1.0 / self.layers, 34 * b * s * h

    def cost(self, depth: int, pipelines: int = 1) -> CostModel:
        """The schedule compiler's cost model (milliseconds) at this depth; with
        D pipelines each stage's gradients are all-reduced (ring: 2 (D-1)/D of them)."""
        per_stage = self.stage_layers(depth)
        forward, backward, step, swap_bytes = (x * per_stage for x in self._layer_costs())
        if not self.calibration:
            step = 1.0  # per stage, whatever its size
        act_bytes = 2 * self.microbatch * self.seq * self.hidden
        grad_bytes = 2 * self.layer_params * per_stage
        reduce = grad_bytes * 2 * (pipelines - 1) / pipelines / NETWORK * 1e3 if pipelines > 1 else 0.0
        return CostModel(forward=forward, backward=backward, transfer=act_bytes / NETWORK * 1e3,
                         swap=swap_bytes / PCIE * 1e3, reduce=reduce, step=step,
                         sync_transfer=grad_bytes / NETWORK * 1e3)

    def stage_params(self, depth: int) -> float:
        return self.layer_params * self.stage_layers(depth)

    def stage_state_bytes(self, depth: int) -> float:
        """Parameters and optimizer state of one stage: what a handover moves."""
        return STATE_BYTES_PER_PARAM * self.stage_params(depth)

    def samples_per_iteration(self) -> int:
        return self.microbatch * self.microbatches

    def links(self, depth: int, pipelines: int, replicas: bool) -> dict[str, float]:
        """Bytes over the network per fault-free iteration, by kind, in fp16: each
        boundary's activations and input gradients, the replica syncs (a stage's
        gradients to its replica's holder) and a ring all-reduce's 2 (D-1) copies."""
        boundary = 2 * self.microbatch * self.seq * self.hidden * self.microbatches * (depth - 1)
        params = 2 * self.layer_params * self.layers
        out = {"activations, forward": boundary, "input gradients, back": boundary}
        if replicas:
            out["replica syncs"] = pipelines * params
        if pipelines > 1:
            out["data-parallel reduce"] = 2 * (pipelines - 1) * params
        return out

    def sources(self) -> dict:
        """Which numbers are measured and which are arithmetic, for the JSON output."""
        measured = "measured on CPU (sim/calibration.json), scaled to the GPU"
        which = {k: measured if self.calibration else "arithmetic" for k in ("forward", "backward", "step")}
        which["swap"] = ("bytes measured, over PCIe" if self.calibration else "arithmetic")
        which.update(transfer="arithmetic", reduce="arithmetic", state_bytes="arithmetic")
        out = {"profile": self.name, "source": "calibrated" if self.calibration else "arithmetic",
               "numbers": which, "gpu_peak_flops": GPU_PEAK_FLOPS, "gpu_utilisation": GPU_UTILISATION,
               "gpu_flops_sustained": self.gpu_flops,
               "gpu_memory_bandwidth": GPU_MEMORY_BANDWIDTH, "network": NETWORK, "pcie": PCIE,
               "state_bytes_per_param": STATE_BYTES_PER_PARAM}
        if self.calibration:
            out["calibration"] = self.calibration.describe()
        return out


PROFILES = {
    # GPT-2 XL's shape (1.5B parameters): 48 layers, h=1600, 1024 tokens.
    "gpt2": Profile("gpt2", layers=48, hidden=1600, seq=1024, microbatch=2, microbatches=24),
    # BERT-large: 24 layers, h=1024, 512 tokens.
    "bert-large": Profile("bert-large", layers=24, hidden=1024, seq=512, microbatch=8, microbatches=24),
}
SOURCES = ("calibrated", "arithmetic")


def profile(name: str, source: str = "calibrated") -> Profile:
    """Profile `name` from `source`; calibrated falls back to arithmetic when the
    calibration file does not hold that model (the output's `sources` says so)."""
    base = PROFILES[name]
    if source == "arithmetic":
        return base
    if source != "calibrated":
        raise ValueError(f"unknown profile source {source!r} (choose from {', '.join(SOURCES)})")
    calibration = load_calibration(name)
    return replace(base, calibration=calibration) if calibration else base


@dataclass(frozen=True)
class MeasuredProfile:
    """Iteration times measured by bamboo-train (milliseconds, by the number of
    pipelines D) at one depth: the simulator uses them instead of the arithmetic."""
    name: str
    depth: int
    iteration_ms: tuple[tuple[int, float], ...]   # (pipelines, milliseconds)
    samples: int
    handover_ms: float = 1500.0   # measured pause of a reconfiguration on that machine

    def samples_per_iteration(self) -> int:
        return self.samples
