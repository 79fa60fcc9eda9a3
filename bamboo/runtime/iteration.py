"""What one iteration of a node's stream holds while it runs: the microbatches'
inputs, activations and gradients, where the stream is, which stages were reduced,
tied and prepared for their step. The executor makes a fresh one at the start of
every iteration and keeps it until the next (its host buffers are released then,
and a rollback reads its undo), so no field of an iteration outlives it unseen."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from schedules.ir import Instr

from bamboo.runtime.calibration import OpTimes
from bamboo.transport.comm import Comm
from bamboo.transport.staging import Copy

if TYPE_CHECKING:
    from bamboo.runtime.failover import Failover
    from bamboo.runtime.sync import EarlySync
    from bamboo.runtime.two_pass import WeightsOwed

Key = tuple[int, int]  # (stage, local microbatch)


@dataclass
class IterationState:
    iteration: int
    mbs: range                 # this pipeline's microbatches: local index -> global sample index
    comm: Comm
    failover: Failover
    loss_scale: float = 1.0    # fp16: this iteration's loss is multiplied by it
    base: dict = field(default_factory=dict)  # messages received before this iteration, per channel
    stream: list[Instr] = field(default_factory=list)  # the stream being run, and the position in it
    pc: int = 0
    last_owed: int = -1        # where the stream's last instruction outside the step phase is
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> stage 0's input
    labels: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> the last stage's labels
    drawn: dict[int, tuple] = field(default_factory=dict)  # microbatch -> inputs and labels, drawn ahead (load)
    acts: dict[Key, torch.Tensor | Copy] = field(default_factory=dict)  # a forward's output, to send or read
    acts_host: dict[Key, Copy] = field(default_factory=dict)  # an output kept in host memory
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # the gradient w.r.t. a stage's input
    states: dict[Key, tuple] = field(default_factory=dict)  # input, output, saved tensors (FRC: swappable)
    weights_owed: dict[Key, WeightsOwed] = field(default_factory=dict)  # a split backward's weight pass to run
    losses: dict[int, torch.Tensor | float] = field(default_factory=dict)  # global microbatch -> its loss
    losses_written: set[int] = field(default_factory=set)  # global microbatches whose loss is in etcd
    busy: float = 0.0          # seconds in COMPUTE ops (CPU only: 0 on CUDA)
    times: OpTimes | None = None  # where timed ops' durations go (an epoch's calibration; CPU only)
    deferred: list[Instr] = field(default_factory=list)  # step-phase instructions put off, in stream order
    reduced: set[int] = field(default_factory=set)       # stages reduced across pipelines
    tied_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # tied weight -> its summed gradient
    tie_given: set[Key] = field(default_factory=set)     # (tied weight, stage): that copy holds the sum
    prepared: dict[int, bool] = field(default_factory=dict)  # stage -> gradients ready to step (False: overflow)
    undo: dict[int, tuple] = field(default_factory=dict)  # stage -> its parameters and optimizer state before
    norms_read: bool = False   # every stage's squared norm was read, and so ...
    multiplier: float | None = None  # ... what the gradients are multiplied by (None: overflow)
    overflow: bool | None = None     # fp16: whether this iteration's steps were skipped, once known
    early_syncs: dict[int, EarlySync] = field(default_factory=dict)  # stage -> its sync posted in buckets
    sync_parts: dict[Key, list] = field(default_factory=dict)  # (replica stage, owner) -> its sync's parts so far
