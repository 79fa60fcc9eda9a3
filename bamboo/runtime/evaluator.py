"""Evaluation on the pipeline: the validation loss after an iteration's step.

The compiler's forward-only stream (schedules/evaluation.py) is interpreted like
the training stream, one method per op (EVAL_OPS), on the world group's evaluation channels
(bamboo/transport/comm.py), with every module in eval mode (no dropout) under no_grad:
parameters, gradients, optimizer state, RNG state and the training samples are
left as they were, so training computes what it would without evaluations. The
last stage writes each validation microbatch's loss to etcd (VAL_LOSS), before
the node reports the iteration; the launcher averages them.

A death in the pipeline during an evaluation cuts it short. The death is
recorded as in training (a broken channel, a silent lease), every node of the
pipeline stops its evaluation stream at its next instruction or wait, and the
boundary then handles the death as one between iterations: the iteration's
training is complete, its losses are in etcd. That iteration's validation loss
is missing (the launcher records an `eval_skipped` event); training goes on.
"""
from __future__ import annotations

from typing import Callable

import torch

from schedules.compiler import compile_eval
from schedules.ir import RECVS, Instr, Op

from bamboo.control.config import JobConfig
from bamboo.control.exits import preempt_if_due
from bamboo.control.protocol import VAL_LOSS, Loss
from bamboo.model.builtin import evaluating, mixed_precision
from bamboo.transport.comm import Comm, Interrupted, PeerFailure


class EvalCut(Exception):
    """A node of this pipeline died: its evaluation stops here."""


class Evaluator:
    def __init__(self, cfg: JobConfig, nodes: tuple[int, ...], me: int, modules: dict, corpus,
                 device: torch.device, cluster):
        self.cfg, self.nodes, self.me = cfg, nodes, me
        self.P = len(nodes)
        self.modules, self.corpus, self.device, self.cluster = modules, corpus, device, cluster
        self.iteration = -1
        self.mbs = range(0)             # this pipeline's validation microbatches (global indices)
        self.comm: Comm | None = None   # the world group's evaluation channels
        self.failover = None
        self.inputs, self.labels, self.acts = {}, {}, {}
        self.cut_on: Comm | None = None  # a world group whose evaluation channels a cut left unsettled

    def run(self, iteration: int, microbatches: range, comm: Comm, failover) -> bool:
        """This node's evaluation stream after `iteration`'s step; False when a death
        in the pipeline cut it short (or cut the last one short on this group)."""
        if comm is self.cut_on:
            return False  # messages of the cut evaluation may still be on its channels
        self.iteration, self.mbs, self.comm, self.failover = iteration, microbatches, comm.evaluation, failover
        self.inputs, self.labels, self.acts = {}, {}, {}
        stream = compile_eval(self.P, len(microbatches), failover.failed, failover.redundancy).streams[self.me]
        self._expect(stream)
        try:
            with torch.no_grad(), evaluating(self.modules.values()):
                self._run(stream)
            return True
        except PeerFailure as e:
            failover.detected(e.node, str(e))
        except EvalCut:
            pass
        self.cut_on = comm
        return False

    def _run(self, stream: list[Instr]) -> None:
        for pc, ins in enumerate(stream):
            preempt_if_due(self.cfg, self.cluster, self.nodes[self.me], self.iteration, pc, "eval")
            try:
                EVAL_OPS[ins.op](self, ins)
            except Interrupted:  # a receive gave up: the failover says why
                self._on_event(self.failover.poll())
                raise EvalCut("a receive was given up") from None
            self._on_event(self.failover.poll())
        preempt_if_due(self.cfg, self.cluster, self.nodes[self.me], self.iteration, len(stream), "eval")  # after it

    def _on_event(self, event) -> None:
        """An abandoned iteration and this node's own death end the evaluation as
        they end training; any other death in the pipeline cuts it."""
        if event is None:
            return
        self.failover.settle(event)  # an abort, this node's death, silent peers
        raise EvalCut(f"evaluation of iteration {self.iteration} cut short: {event}")

    def _expect(self, stream: list[Instr]) -> None:
        """Arm the evaluation mailboxes with what this stream receives."""
        base = self.comm.counts()
        for ins in stream:
            if ins.op in RECVS:
                key = (self.nodes[ins.peer], RECVS[ins.op])
                base[key] = base.get(key, 0) + 1
                self.comm.expect(*key, base[key])

    # -- ops ---------------------------------------------------------------------------
    def load(self, ins: Instr) -> None:
        x, y = self.corpus.validation(self.mbs[ins.mb])
        self.inputs[ins.mb], self.labels[ins.mb] = x.to(self.device), y.to(self.device)

    def forward(self, ins: Instr) -> None:
        s, mb = ins.stage, ins.mb
        inp = self.inputs.pop(mb) if s == 0 else self.acts.pop((s - 1, mb))
        with mixed_precision(self.cfg.recipe.precision, self.device):
            if s < self.P - 1:
                self.acts[(s, mb)] = self.modules[s](inp)
                return
            loss = self.modules[s](inp, self.labels.pop(mb))
        self.cluster.put(VAL_LOSS(self.iteration, self.mbs[mb]), Loss(loss.item()))

    def send_act(self, ins: Instr) -> None:
        peer = self.nodes[ins.peer]
        self.comm.send(peer, Op.SEND_ACT, self.acts.pop((ins.stage, ins.mb)), lambda: self.failover.peer_gone(peer))

    def recv_act(self, ins: Instr) -> None:
        self.acts[(ins.stage, ins.mb)] = self.comm.recv(self.nodes[ins.peer], Op.SEND_ACT, self.failover.keep_waiting)


# The forward-only instruction set an evaluation stream uses, and the method of each.
EVAL_OPS: dict[Op, Callable[[Evaluator, Instr], None]] = {
    Op.LOAD: Evaluator.load,
    Op.FORWARD: Evaluator.forward,
    Op.SEND_ACT: Evaluator.send_act,
    Op.RECV_ACT: Evaluator.recv_act,
}
