"""Model profiles for the cluster simulator: per-stage forward/backward time, what
a message, a swap and a layer handover cost, and how much memory a stage needs.

Where the numbers come from: transformer arithmetic, not measurement. One layer's
forward pass costs 24*b*s*h^2 + 4*b*s^2*h floating-point operations (b sequences
of s tokens, hidden size h: the QKV/output projections, the 4h MLP and the
attention products), its backward twice that. An EC2 p3.2xlarge has one V100
(125 TFLOP/s fp16 peak); we assume 30% of peak in training. Activations between
stages are b*s*h fp16 values over the instance's network (10 Gbit/s nominal, we
assume 1 GB/s); FRC intermediates swapped to host memory are about 34*b*s*h bytes
per layer (the usual estimate without attention scores) over PCIe (assumed
10 GB/s). A layer has 12*h^2 parameters; mixed-precision Adam keeps 16 bytes per
parameter (what a handover or a checkpoint moves). A profile measured by
`bamboo-train` (its metrics' iteration time) can replace the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedules.cost import CostModel

TFLOPS = 125e12 * 0.30   # V100 fp16 at 30% of peak
NETWORK = 1e9            # bytes/s between nodes
PCIE = 10e9              # bytes/s host <-> device


@dataclass(frozen=True)
class Profile:
    name: str
    layers: int
    hidden: int
    seq: int
    microbatch: int        # sequences per microbatch
    microbatches: int      # global microbatches per iteration (split over pipelines)

    @property
    def layer_forward_ms(self) -> float:
        b, s, h = self.microbatch, self.seq, self.hidden
        return (24 * b * s * h * h + 4 * b * s * s * h) / TFLOPS * 1e3

    @property
    def layer_params(self) -> int:
        return 12 * self.hidden * self.hidden

    def stage_layers(self, depth: int) -> float:
        return self.layers / depth

    def cost(self, depth: int, pipelines: int = 1) -> CostModel:
        """The schedule compiler's cost model (milliseconds) at this depth; with
        D pipelines each stage's gradients are all-reduced (ring: 2 (D-1)/D of them)."""
        per_stage = self.stage_layers(depth)
        forward = self.layer_forward_ms * per_stage
        act_bytes = 2 * self.microbatch * self.seq * self.hidden
        swap_bytes = 34 * self.microbatch * self.seq * self.hidden * per_stage
        grad_bytes = 2 * self.layer_params * per_stage
        reduce = grad_bytes * 2 * (pipelines - 1) / pipelines / NETWORK * 1e3 if pipelines > 1 else 0.0
        return CostModel(forward=forward, backward=2 * forward, transfer=act_bytes / NETWORK * 1e3,
                         swap=swap_bytes / PCIE * 1e3, reduce=reduce, step=1.0,
                         sync_transfer=grad_bytes / NETWORK * 1e3)

    def stage_state_bytes(self, depth: int) -> float:
        """Parameters and optimizer state of one stage: what a handover moves."""
        return 16 * self.layer_params * self.stage_layers(depth)

    def samples_per_iteration(self) -> int:
        return self.microbatch * self.microbatches


PROFILES = {
    # GPT-2 XL's shape (1.5B parameters): 48 layers, h=1600, 1024 tokens.
    "gpt2": Profile("gpt2", layers=48, hidden=1600, seq=1024, microbatch=2, microbatches=24),
    # BERT-large: 24 layers, h=1024, 512 tokens.
    "bert-large": Profile("bert-large", layers=24, hidden=1024, seq=512, microbatch=8, microbatches=24),
}


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
