"""A cost model: how long each instruction keeps its node busy, and how long a message flies.

Units are arbitrary (think milliseconds). Per-stage forward and backward times
may differ; redundant work costs its normal counterpart times a factor. Sends are
asynchronous: the sender is busy only for `send` time, the message arrives
`transfer` later. Receives cost nothing beyond the wait. A split backward
(early_grads.py) costs `input_share` of a backward for the input gradient and the
rest for the weights.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Sequence

from schedules.ir import Instr, Op
from schedules.layout import ScheduleError


def _per_stage(value: float | Sequence[float], stage: int) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return float(value[stage])


@dataclass(frozen=True)
class CostModel:
    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    transfer: float = 0.05       # activation / gradient message latency
    send: float = 0.0            # sender-side cost of posting a send
    swap: float = 0.05           # one swap-out or swap-in of one microbatch's intermediates
    load: float = 0.0
    reduce: float = 0.0
    step: float = 0.1
    sync_transfer: float = 0.1   # owner -> replica holder, reduced gradients
    frc_factor: float = 1.0      # redundant forward vs normal forward
    brc_factor: float = 1.0      # redundant backward vs normal backward
    input_share: float = 0.5     # a split backward's input pass vs a whole backward (measured 0.6, weights 0.5)
    # caches of this model's own (not init fields: a model made by dataclasses.replace starts its own)
    _table: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    _by_instruction: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # timing_table()

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)):
                object.__setattr__(self, name, tuple(float(v) for v in value))
        for name in ("forward", "backward", "transfer", "send", "swap", "load", "reduce", "step",
                     "sync_transfer", "frc_factor", "brc_factor", "input_share"):
            value = getattr(self, name)
            if not all(0 <= v < math.inf for v in (value if isinstance(value, tuple) else (value,))):
                raise ScheduleError(f"cost model: {name} must be a finite number, not negative (got {value})")

    def check_stages(self, stages: int) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != stages:
                raise ScheduleError(f"cost model: {name} has {len(value)} per-stage values for {stages} stages")

    def duration(self, ins: Instr) -> float:
        key = (ins.op, ins.stage, ins.redundant)
        d = self._table.get(key)
        if d is None:
            d = self._table[key] = self._duration(ins)
        return d

    def timing_table(self) -> dict[Instr, tuple]:
        """What the fast timing pass (schedules/timing/fast.py) knows of
        each instruction met so far under this model, its duration among it, by
        instruction: a dict it reads in C, filling in what it lacks (a compile times
        thousands of them)."""
        return self._by_instruction

    def _duration(self, ins: Instr) -> float:
        op = ins.op
        if op is Op.FORWARD:
            return _per_stage(self.forward, ins.stage) * (self.frc_factor if ins.redundant else 1.0)
        if op is Op.BACKWARD:
            return _per_stage(self.backward, ins.stage) * (self.brc_factor if ins.redundant else 1.0)
        if op is Op.BACKWARD_INPUT:
            return _per_stage(self.backward, ins.stage) * self.input_share
        if op is Op.BACKWARD_WEIGHT:
            return _per_stage(self.backward, ins.stage) * (1.0 - self.input_share)
        if op in (Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_SYNC):
            return self.send
        if op in (Op.SWAP_OUT, Op.SWAP_IN):
            return self.swap
        if op is Op.LOAD:
            return self.load
        if op is Op.REDUCE_GRADS:
            return self.reduce
        if op is Op.OPTIMIZER_STEP:
            return self.step
        return 0.0

    def latency(self, ins: Instr) -> float:
        return self.sync_transfer if ins.op is Op.SEND_SYNC else self.transfer
