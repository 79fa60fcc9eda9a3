"""The executor: interprets one node's instruction stream on torch tensors.

One method per op (the OPS map at the end; the step phase's, from steps to
syncs, in bamboo/runtime/steps.py); what an iteration holds is one
IterationState, made afresh by `run`. A stage's input is always a fresh leaf, so
each stage's backward is separate and yields the gradient to send upstream.
Redundant forwards (FRC) record their saved tensors in a swappable container. A
send to a dead peer is lost like any message to a dead node; a receive from a
dead peer, or a failure recorded by anyone in this pipeline (seen by polling the
failover), hands control to the failover, which returns the recovery stream to
continue with from the same position.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Callable

import torch

from schedules.ir import RECVS, SENDS, Instr, Op
from schedules.layout import Layout
from schedules.overlap import leading_syncs, prefix_ahead
from schedules.recovery import sends_first, tails_last

from bamboo.control.config import JobConfig, dropout_seed_for
from bamboo.control.exits import preempt_if_due
from bamboo.control.protocol import LOSS, Local, Loss, NodeId
from bamboo.model import recipe
from bamboo.model.builtin import dropout_seed, mixed_precision
from bamboo.runtime.ahead import Ahead
from bamboo.runtime.calibration import OpTimes
from bamboo.runtime.failover import Failover
from bamboo.runtime.watch import PeersSilent, TooManyDead
from bamboo.runtime.iteration import IterationState
from bamboo.runtime.steps import StepPhase
from bamboo.runtime.two_pass import input_pass
from bamboo.state.holdings import Stages
from bamboo.transport.comm import Comm, Interrupted, PeerFailure
from bamboo.transport.staging import Copy, Stager
from bamboo.transport.swap import SavedTensors
from schedules.options import Redundancy, ReplicaSync

# Ops whose wall time is this node's own work (the straggler check). Timed on the
# CPU only: CUDA kernels run after their launch returns (see Executor.busy).
COMPUTE = frozenset({Op.LOAD, Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.SWAP_OUT,
                     Op.SWAP_IN, Op.OPTIMIZER_STEP})
# The step phase: when a tie or the global norm joins the stages' steps, a step
# waits for every stage's gradients, so nothing a peer needs for those may wait
# behind one. A node then runs these after every other instruction of its stream.
STEP_PHASE = frozenset({Op.OPTIMIZER_STEP, Op.SEND_SYNC, Op.RECV_SYNC})


class Executor(StepPhase):
    def __init__(self, cfg: JobConfig, nodes: tuple[int, ...], me: int, stages: Stages, corpus, reducer, cluster,
                 stager: Stager):
        """`stager` moves swaps and kept outputs to host memory and back, on its device."""
        self.cfg, self.nodes, self.me = cfg, nodes, me
        self.P = len(nodes)
        self.modules, self.optimizers = stages.modules, stages.optimizers
        self.corpus, self.device, self.reducer, self.cluster = corpus, stager.device, reducer, cluster
        self.params = {s: {p.data_ptr() for p in m.parameters()} for s, m in self.modules.items()}
        self.stager = stager
        self.keep_undo = cfg.cluster.elastic  # with agents every step can be undone, for a redo
        self.tied = list(stages.tied)     # per tied weight: its stages, stage -> this node's copy
        self.owed: dict[int, float] = {}  # replica stage -> the rate of the step it owes (settle)
        # the sync in the next iteration (the epoch's: the worker sets it): each replica's
        # sync goes in the next iteration, of the owner's stepped gradients kept here
        self.late = False
        self.kept_grads: dict[int, torch.Tensor] = {}
        self.overflowed_before = False  # fp16: the iteration before's steps were skipped (so are its late syncs')
        # With clipping, ties (the model's, on every node) or fp16's loss scale, steps
        # and syncs wait for the rest of the stream (STEP_PHASE).
        self.step_after_reduces = bool(cfg.recipe.grad_clip) or bool(self.tied) or cfg.recipe.loss_scaling
        self.it: IterationState | None = None  # the iteration under way, or the last one run
        self.ahead: Ahead | None = None   # the next iteration's first forwards, run while this node waits
        self.ahead_next: int | None = None  # the iteration whose forwards start as this stream ends (worker)
        self.ahead_taken = 0              # iterations that began with work run ahead

    @property
    def busy(self) -> float:
        """Seconds of the last iteration in COMPUTE ops (CPU only: 0 on CUDA)."""
        return self.it.busy if self.it else 0.0

    @property
    def overflow(self) -> bool | None:
        """fp16: whether the last iteration's steps were skipped, once known."""
        return self.it.overflow if self.it else None

    def peer(self, local: Local) -> NodeId:
        """The node at a place of this pipeline (an instruction's `peer`)."""
        return NodeId(self.nodes[local])

    # -- one iteration -------------------------------------------------------------------
    def run(self, iteration: int, stream: list[Instr], microbatches: range, comm: Comm, failover: Failover,
            loss_scale: float = 1.0, times: OpTimes | None = None) -> None:
        """Run `stream` to its end, and through every recovery a death in the
        pipeline brings, until every node of the pipeline has finished. `times`: where
        each op's duration goes (an epoch's calibration, bamboo/runtime/calibration.py)."""
        ahead = self.ahead  # its thread runs on (nothing below changes what it reads): held to drop if this raises
        self._release()
        for s, m in self.modules.items():
            if s not in self.owed:  # an owed step's gradients stay until it is taken
                m.zero_grad(set_to_none=True)
        self.overflowed_before = bool(self.it is not None and self.it.overflow)
        self.it = IterationState(iteration, microbatches, comm, failover, loss_scale, base=comm.counts(), times=times)
        sent = {i.stage for i in stream if i.op is Op.SEND_SYNC}  # a stage with no holder now keeps none
        self.kept_grads = {s: g for s, g in self.kept_grads.items() if s in sent}
        self._expect(stream)
        taken = ahead.take(self.it, stream) if ahead is not None else 0
        self.ahead_taken += taken > 0
        try:
            pc = 0
            if taken:  # the late syncs before the work run ahead go first
                pc = ahead.post(self, stream, self._send_leading_syncs(stream, failover), failover)
            self.ahead = None
            self._run_stream(stream, pc, comm, failover)
        finally:
            self._close_syncs()

    def _run_stream(self, stream: list[Instr], pc: int, comm: Comm, failover: Failover) -> None:
        """`run`'s loop, from instruction `pc` on."""
        while True:
            while pc < len(stream) or self.it.deferred or comm.pending():
                ins, self.it.stream, self.it.pc = (stream[pc] if pc < len(stream) else None), stream, pc
                try:
                    if self.it.deferred and pc > self.it.last_owed:
                        self._run_deferred()
                    if ins is None:  # the sends' outcomes, before this node says it finished
                        comm.flush(failover.peer_gone)
                        continue
                    self._maybe_preempt(pc)
                    if self.step_after_reduces and ins.op in STEP_PHASE and pc < self.it.last_owed \
                            and not self._late_sync(ins):
                        self.it.deferred.append(ins)
                    else:
                        self._execute(ins)
                    pc += 1
                except PeerFailure as e:
                    failover.detected(e.node, str(e))
                    if ins is not None and ins.op in SENDS:
                        pc += 1  # lost with the dead node, as the compiler assumes
                except Interrupted:
                    pass
                if (event := failover.poll()) is not None:
                    stream = self._on_event(event, stream, pc)
            # Done here, but a neighbour may still die before the pipeline is: stay
            # available to re-send what it needs until every node has finished.
            self._maybe_preempt(pc)  # INSTRUCTION = stream length: after the stream
            failover.finished(also=self._losses_to_write())
            if self.ahead_next is not None:  # the next iteration's forwards may begin meanwhile
                self.start_ahead(self.ahead_next, failover)
                self.ahead_next = None
            if (event := failover.linger(idle=self.settle_replicas)) is None:  # owed steps fit in the wait
                break
            stream = self._on_event(event, stream, pc)

    def _send_leading_syncs(self, stream: list[Instr], failover: Failover) -> int:
        """Before the work run ahead is taken: the late syncs the stream begins with
        (bamboo/runtime/ahead.py), each a send whose outcome comes later; their count."""
        first = leading_syncs(stream)
        for ins in stream[:first]:
            try:
                self._execute(ins)
            except PeerFailure as e:  # lost with its holder, as any send to a dead node
                failover.detected(e.node, str(e))
        return first

    def start_ahead(self, iteration: int, failover: Failover) -> None:
        """Start the first loads and forwards of iteration `iteration` on a thread
        (bamboo/runtime/ahead.py), on the stream it runs if the boundary changes
        nothing: this one's or, after a death the pipeline recovered from, the merged
        pipeline's; `run` takes them if they fit."""
        now = failover.now
        if self.ahead is not None or self.device.type != "cpu":
            return
        streams = failover.streams_for(now.microbatches, now.failed, now.cost) if now.recovered else now.streams
        prefix = prefix_ahead(streams[self.me])
        if prefix:
            self.ahead = Ahead(self, OPS, iteration, streams[self.me], prefix, self.it.mbs)

    def drop_ahead(self) -> None:
        """Forget the work run ahead (the next iteration will not run that stream)."""
        if self.ahead is not None:
            self.ahead.drop()
            self.ahead = None

    def _execute(self, ins: Instr) -> None:
        if self.owed and (ins.op in RECVS or ins.stage in self.owed):
            self.settle_replicas()  # in the wait a receive starts with, or before the replica is used
        began = time.monotonic()
        OPS[ins.op](self, ins)
        if self.device.type == "cpu":
            took = time.monotonic() - began
            if self.it.times is not None:
                self.it.times.add(ins, took)
            if ins.op in COMPUTE:
                self.it.busy += took

    def _on_event(self, event, stream: list[Instr], pc: int) -> list[Instr]:
        """Act on what the failover saw; return the stream to go on with."""
        self.settle_replicas()  # a recovery runs on the replicas
        self.it.failover.settle(event)  # an abort, this node's death, silent peers
        if isinstance(event, PeersSilent):
            return stream
        self.drop_ahead()  # begun as the stream ended, on a layout now changing; and its dropout
        # seeds the one global generator that a recovery's forwards also draw from
        if isinstance(event, TooManyDead):
            self.it.failover.unsurvivable(event.why)
        return self._replan(self.it.failover, stream, pc)

    def _replan(self, failover, old: list[Instr], pc: int) -> list[Instr]:
        """Switch to the recovery stream. This node may already be past its recovery
        point when what it ran there is what the recovery says too (a message from
        a node that recovered first let it go on): anything else is a bug."""
        stream, resume_at = failover.resolve()
        if pc > resume_at and old[resume_at:pc] != stream[resume_at:pc]:
            raise RuntimeError(f"node ran past its recovery point ({pc} > {resume_at}) and off the plan")
        late = failover.compiled_sync is not ReplicaSync.END
        stream = stream[:pc] + sends_first(tails_last(stream[pc:], late), self._can_send)
        self._expect(stream)
        return stream

    def _late_sync(self, ins: Instr) -> bool:
        """--replica-sync next: the iteration before's sync and replica step, whose
        gradients were tied and clipped at the owner's step: not this step phase's."""
        return self.late and (ins.op is not Op.OPTIMIZER_STEP or ins.redundant)

    def _can_send(self, ins: Instr) -> bool:
        """Whether what `ins` sends is here already (a kept gradient or activation)."""
        key = (ins.stage, ins.mb)
        return key in self.it.grads if ins.op is Op.SEND_GRAD else key in self.it.acts

    def _expect(self, stream: list[Instr]) -> None:
        """Arm the mailboxes with how many messages this iteration brings per channel;
        note where the stream's last instruction outside the step phase is."""
        self.it.last_owed = max((pc for pc, i in enumerate(stream) if i.op not in STEP_PHASE), default=-1)
        counts = Counter((self.peer(i.peer), RECVS[i.op]) for i in stream if i.op in RECVS)
        for (peer, kind), n in counts.items():
            self.it.comm.expect(peer, kind, self.it.base.get((peer, kind), 0) + n)

    def _maybe_preempt(self, pc: int) -> None:
        preempt_if_due(self.cfg, self.cluster, self.peer(self.me), self.it.iteration, pc, "train")

    # -- ops ---------------------------------------------------------------------------
    def load(self, ins: Instr) -> None:
        """Microbatch ins.mb's inputs and labels, drawn together with those of every
        later load of the stream: one at a time between forwards, each draw took
        ~0.5 ms on the critical path, in a row ~0.07 (docs/HOTPATH.md, "Messages")."""
        if ins.mb not in self.it.drawn:
            later = [i.mb for i in self.it.stream[self.it.pc + 1:] if i.op is Op.LOAD and i.mb not in self.it.drawn]
            for mb in [ins.mb, *later]:
                self.it.drawn[mb] = self.corpus.microbatch(self.it.iteration, self.it.mbs[mb])
        x, y = self.it.drawn.pop(ins.mb)
        if self.device.type == "cuda":  # from pinned memory the copies do not stall the host
            x, y = x.pin_memory(), y.pin_memory()
        self.it.inputs[ins.mb] = x.to(self.device, non_blocking=True)
        self.it.labels[ins.mb] = y.to(self.device, non_blocking=True)

    def forward(self, ins: Instr) -> None:
        s, mb = ins.stage, ins.mb
        if s == 0:
            inp = self.it.inputs[mb]
        else:
            inp = self._act((s - 1, mb)).to(self.device).detach().requires_grad_(True)
        labels = self.it.labels[mb] if s == self.P - 1 else None
        saved = SavedTensors(self.params[s]) if ins.redundant else None
        seed = dropout_seed_for(self.cfg.model.seed, self.it.iteration, self.it.mbs[mb])
        with dropout_seed(seed), mixed_precision(self.cfg.recipe.precision, self.device), \
                (saved.recording() if saved else contextlib.nullcontext()):
            out = self.modules[s](inp, labels) if labels is not None else self.modules[s](inp)
        self.it.states[(s, mb)] = (inp, out, saved)
        if s < self.P - 1:
            self.it.acts[(s, mb)] = out.detach()

    def backward(self, ins: Instr) -> None:
        inp, root, grad = self._backward_root(ins)
        self._sync_early(ins)
        root.backward(grad)
        if ins.stage > 0:
            self.it.grads[(ins.stage, ins.mb)] = inp.grad

    def _backward_root(self, ins: Instr) -> tuple:
        """(the stage's input, what its backward starts from, the gradient it starts
        with): the last stage starts from its scaled loss, as the reference does."""
        s, mb = ins.stage, ins.mb
        inp, out, _ = self.it.states.pop((s, mb))
        if s == self.P - 1:
            self.it.losses[self.it.mbs[mb]] = out.detach()  # leaves with the gradient (send_grad)
            return inp, recipe.scaled_loss(out, self.cfg.schedule.microbatches, self.it.loss_scale), None
        return inp, out, self.it.grads[(s + 1, mb)]

    def backward_input(self, ins: Instr) -> None:
        """The gradient w.r.t. the stage's input only, for SEND_GRAD to send at once;
        what the weights need is kept (bamboo/runtime/two_pass.py)."""
        inp, root, grad = self._backward_root(ins)
        params = [p for p in self.modules[ins.stage].parameters() if p.requires_grad]
        self.it.grads[(ins.stage, ins.mb)], self.it.weights_owed[(ins.stage, ins.mb)] = \
            input_pass(root, grad, inp, params)

    def backward_weight(self, ins: Instr) -> None:
        """The weight gradients a backward_input left: the rest of its backward,
        accumulated as `backward` accumulates them."""
        owed = self.it.weights_owed.pop((ins.stage, ins.mb))
        self._sync_early(ins)
        owed.weight_pass()

    def swap_out(self, ins: Instr) -> None:
        key = (ins.stage, ins.mb)
        self.it.states[key][2].swap_out(self.stager)
        if key in self.it.acts:
            self.it.acts_host[key] = self.stager.to_host(self._act(key))
            del self.it.acts[key]

    def swap_in(self, ins: Instr) -> None:
        """Start this swap-in, and the next one of the stream too (a prefetch: its
        copies overlap what runs until its BRC)."""
        for key in [(ins.stage, ins.mb)] + [(i.stage, i.mb) for i in self.it.stream[self.it.pc + 1:]
                                           if i.op is Op.SWAP_IN][:1]:
            if key in self.it.states:
                self.it.states[key][2].swap_in()
            self._bring_back(key)

    def _bring_back(self, key: tuple[int, int]) -> None:
        """Start the copy back of an output kept in host memory, if it is there."""
        if key in self.it.acts_host:
            self.it.acts[key] = self.stager.to_device(self.it.acts_host.pop(key).tensor)

    def _act(self, key: tuple[int, int]) -> torch.Tensor:
        """An output of this node's forward: on the device, once its copy back
        (from a swap, or lazy's kept inputs) is ordered before what reads it."""
        if key not in self.it.acts:
            self._bring_back(key)
        if isinstance(self.it.acts[key], Copy):
            self.it.acts[key] = self.it.acts[key].wait_here()
        return self.it.acts[key]

    def _release(self) -> None:
        """The last iteration's host buffers back to the pool (FRC results that BRC
        never needed, lazy's kept inputs)."""
        if self.it is None:
            return
        for _, _, saved in self.it.states.values():
            if saved is not None:
                saved.release()
        self.stager.release(list(self.it.acts_host.values()))
        self.it.acts_host = {}

    def _send(self, ins: Instr, kind: Op, tensor: torch.Tensor, note=None, keep: bool = False) -> Copy | None:
        """A send posted to go out while this node computes on; its outcome is learnt
        later (Comm.post), at the latest before the stream is done. `keep`: the host
        copy it is sent from, if there is one, for this node to keep."""
        return self.it.comm.post(self.peer(ins.peer), kind, tensor, note, keep=keep)

    def send_act(self, ins: Instr) -> None:
        key = (ins.stage, ins.mb)
        # lazy on CUDA: the replica's input, should its owner die, is kept in host memory,
        # not on the GPU; on gloo the copy the message is sent from is that copy
        keep = self.it.failover.redundancy == Redundancy.LAZY and self.device.type == "cuda"
        host = self._send(ins, Op.SEND_ACT, self._act(key), keep=keep)
        if keep:
            act = self.it.acts.pop(key)
            self.it.acts_host[key] = host if host is not None else self.stager.to_host(act)

    def recv_act(self, ins: Instr) -> None:
        self.it.acts[(ins.stage, ins.mb)] = self.it.comm.recv(self.peer(ins.peer), Op.SEND_ACT,
                                                              self.it.failover.keep_waiting)

    def send_grad(self, ins: Instr) -> None:
        # The last stage's gradient carries its microbatch's loss: should this node die
        # once it left, the receiver, which takes the stage over, holds the loss.
        loss = self.it.losses[self.it.mbs[ins.mb]] if ins.stage == self.P - 1 else None  # (a tensor: no sync)
        self._send(ins, Op.SEND_GRAD, self.it.grads[(ins.stage, ins.mb)], loss)

    def recv_grad(self, ins: Instr) -> None:
        grad, loss = self.it.comm.recv_noted(self.peer(ins.peer), Op.SEND_GRAD, self.it.failover.keep_waiting)
        self.it.grads[(ins.stage, ins.mb)] = grad
        if loss is not None:
            self.it.losses[self.it.mbs[ins.mb]] = loss

    def _losses_to_write(self) -> dict:
        """What the last stage's owner (after any failover) writes with its finished
        mark, in one etcd transaction: the pipeline's losses it computed and those
        that came with the gradients of a last stage that died since. Any it gains
        after a first mark (a failover) go with its next."""
        new = sorted(g for g in self.it.losses if g not in self.it.losses_written)
        if Layout(self.P, self.it.failover.failed).owner(self.P - 1) != self.me or not new:
            return {}
        self.it.losses_written.update(new)
        return {LOSS(self.it.iteration, g): Loss(float(self.it.losses[g])) for g in new}

    def reduce_grads(self, ins: Instr) -> None:
        if ins.stage == self.P - 1 and self.reducer.D > 1 and (losses := self._losses_to_write()):
            # Once the pipeline's gradients are in the sum, its losses must outlive it:
            # a burst may take all of its nodes before the finished mark that would carry them.
            self.cluster.put_all(losses)
        self.reducer.allreduce(self.it.iteration, ins.stage, self.modules[ins.stage])
        self.it.reduced.add(ins.stage)

    def _run_deferred(self) -> None:
        """The step phase put off until the rest of the stream ran, in order. A sync
        to a dead peer is lost like any send; a wait interrupted keeps its place."""
        while self.it.deferred:
            ins = self.it.deferred[0]
            try:
                self._execute(ins)
            except PeerFailure as e:
                self.it.failover.detected(e.node, str(e))
            self.it.deferred.pop(0)


# The instruction set and the method that runs each op: checked against Op (tests/architecture/test_runtime_state.py).
OPS: dict[Op, Callable[[Executor, Instr], None]] = {
    Op.LOAD: Executor.load,
    Op.FORWARD: Executor.forward,
    Op.BACKWARD: Executor.backward,
    Op.BACKWARD_INPUT: Executor.backward_input,
    Op.BACKWARD_WEIGHT: Executor.backward_weight,
    Op.SEND_ACT: Executor.send_act,
    Op.RECV_ACT: Executor.recv_act,
    Op.SEND_GRAD: Executor.send_grad,
    Op.RECV_GRAD: Executor.recv_grad,
    Op.SWAP_OUT: Executor.swap_out,
    Op.SWAP_IN: Executor.swap_in,
    Op.REDUCE_GRADS: Executor.reduce_grads,
    Op.OPTIMIZER_STEP: Executor.optimizer_step,
    Op.SEND_SYNC: Executor.send_sync,
    Op.RECV_SYNC: Executor.recv_sync,
}
