"""The instruction IR: what one node does, in order, during one training iteration.

An instruction is a small immutable tuple. Every pass of the compiler reads and
writes lists of them; the executor in `bamboo` interprets them on tensors, the
engine (engine.py) interprets them on a cost model. Node ids are the original ones: node i
starts as stage i of its pipeline and keeps its id after others fail.
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    LOAD = "load"                      # read microbatch mb (inputs and labels) from the data loader
    FORWARD = "forward"                # forward of `stage` on microbatch mb
    BACKWARD = "backward"              # backward of `stage`; accumulates that stage's weight gradients
    BACKWARD_INPUT = "backward_input"  # only the gradient w.r.t. the input of `stage` (sent on at once) ...
    BACKWARD_WEIGHT = "backward_weight"  # ... then its weight gradients (schedules/early_grads.py)
    SEND_ACT = "send_act"              # output activation of `stage` for mb -> peer
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"            # gradient w.r.t. the input of `stage` for mb -> peer
    RECV_GRAD = "recv_grad"
    SWAP_OUT = "swap_out"              # move FRC intermediates of (stage, mb) to host memory
    SWAP_IN = "swap_in"                # bring them back, for BRC or to send them on
    REDUCE_GRADS = "reduce_grads"      # all-reduce `stage`'s gradients across data-parallel pipelines
    OPTIMIZER_STEP = "optimizer_step"  # redundant=True: the replica's step, from synced gradients
    SEND_SYNC = "send_sync"            # owner sends `stage`'s reduced gradients to its replica holder
    RECV_SYNC = "recv_sync"


SENDS = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD, Op.SEND_SYNC: Op.RECV_SYNC}
RECVS = {recv: send for send, recv in SENDS.items()}
COMM = frozenset(SENDS) | frozenset(RECVS)
INPUT_GRADS = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT})     # ops that take the output gradient in
WEIGHT_GRADS = frozenset({Op.BACKWARD, Op.BACKWARD_WEIGHT})   # ops that accumulate weight gradients


def channel(ins: "Instr", node: int) -> tuple[int, int, "Op"]:
    """The FIFO a send or receive on `node` uses: one per (sender, receiver, kind).
    Activations, gradients and syncs travel apart (gloo tags, or one NCCL
    communicator each), so a rerouted activation never queues behind a gradient."""
    if ins.op in SENDS:
        return (node, ins.peer, ins.op)
    return (ins.peer, node, RECVS[ins.op])

# Which fields an op carries in the exchange format.
_FIELDS = {
    Op.LOAD: ("mb",),
    Op.FORWARD: ("stage", "mb", "redundant"),
    Op.BACKWARD: ("stage", "mb", "redundant"),
    Op.BACKWARD_INPUT: ("stage", "mb"),
    Op.BACKWARD_WEIGHT: ("stage", "mb"),
    Op.SWAP_OUT: ("stage", "mb"),
    Op.SWAP_IN: ("stage", "mb"),
    Op.REDUCE_GRADS: ("stage",),
    Op.OPTIMIZER_STEP: ("stage", "redundant"),
    Op.SEND_SYNC: ("stage", "peer"),
    Op.RECV_SYNC: ("stage", "peer"),
}
for _op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD):
    _FIELDS[_op] = ("stage", "mb", "peer")


class Instr(NamedTuple):
    op: Op
    stage: int = -1
    mb: int = -1
    peer: int = -1
    redundant: bool = False

    def to_dict(self) -> dict:
        out = {"op": self.op.value}
        for name in _FIELDS[self.op]:
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Instr":
        op = Op(d["op"])
        return cls(op, **{k: d[k] for k in _FIELDS[op] if k in d})

    def __str__(self) -> str:
        parts = [self.op.value]
        if self.stage >= 0:
            parts.append(f"s{self.stage}")
        if self.mb >= 0:
            parts.append(f"mb{self.mb}")
        if self.peer >= 0:
            parts.append(f"<->n{self.peer}")
        if self.redundant:
            parts.append("(R)")
        return " ".join(parts)


# Short constructors keep the passes readable.
def load(mb: int) -> Instr:
    return Instr(Op.LOAD, mb=mb)


def forward(stage: int, mb: int, redundant: bool = False) -> Instr:
    return Instr(Op.FORWARD, stage, mb, redundant=redundant)


def backward(stage: int, mb: int, redundant: bool = False) -> Instr:
    return Instr(Op.BACKWARD, stage, mb, redundant=redundant)


def send_act(stage: int, mb: int, peer: int) -> Instr:
    return Instr(Op.SEND_ACT, stage, mb, peer)


def recv_act(stage: int, mb: int, peer: int) -> Instr:
    return Instr(Op.RECV_ACT, stage, mb, peer)


def send_grad(stage: int, mb: int, peer: int) -> Instr:
    return Instr(Op.SEND_GRAD, stage, mb, peer)


def recv_grad(stage: int, mb: int, peer: int) -> Instr:
    return Instr(Op.RECV_GRAD, stage, mb, peer)


def backward_input(stage: int, mb: int) -> Instr:
    return Instr(Op.BACKWARD_INPUT, stage, mb)


def backward_weight(stage: int, mb: int) -> Instr:
    return Instr(Op.BACKWARD_WEIGHT, stage, mb)


def swap_out(stage: int, mb: int) -> Instr:
    return Instr(Op.SWAP_OUT, stage, mb)


def swap_in(stage: int, mb: int) -> Instr:
    return Instr(Op.SWAP_IN, stage, mb)


def reduce_grads(stage: int) -> Instr:
    return Instr(Op.REDUCE_GRADS, stage)


def optimizer_step(stage: int, redundant: bool = False) -> Instr:
    return Instr(Op.OPTIMIZER_STEP, stage, redundant=redundant)


def send_sync(stage: int, peer: int) -> Instr:
    return Instr(Op.SEND_SYNC, stage, peer=peer)


def recv_sync(stage: int, peer: int) -> Instr:
    return Instr(Op.RECV_SYNC, stage, peer=peer)


def is_frc(ins: Instr) -> bool:
    """A forward that only keeps a replica warm: eager forward recomputation."""
    return ins.op is Op.FORWARD and ins.redundant
