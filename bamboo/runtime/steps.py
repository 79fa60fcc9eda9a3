"""The step phase of an iteration, a part of the executor (bamboo/runtime/executor.py)
kept apart: ties and the global gradient norm, each stage's optimizer step, the
replica steps owed, the undo of an abandoned iteration's steps, and the sync that
gives a replica its owner's gradients (in buckets: bamboo/runtime/sync.py).

`StepPhase` is a base of `Executor`, whose __init__ sets every attribute these
methods read: cfg, P, me, modules, optimizers, cluster, reducer, tied, owed,
keep_undo, step_after_reduces, late, kept_grads, overflowed_before, and the
iteration under way, it."""
from __future__ import annotations

import time

import torch

from schedules.ir import WEIGHT_GRADS, Instr, Op

from bamboo.control.protocol import NORM, Loss
from bamboo.model import recipe
from bamboo.runtime.lending import KEPT
from bamboo.runtime.sync import EarlySync, receive, sync_params
from bamboo.transport.comm import Interrupted
from schedules.options import Redundancy


class StepPhase:
    def _tie(self) -> None:
        """Before a step (so in the step phase, which no peer's gradients wait
        behind): give this node's copies of each tied weight the gradient summed
        over every copy of the pipeline, once per weight; a copy whose stage this
        node took over after the sum gets the same sum (its share is in it)."""
        for t, (stages, copies) in enumerate(self.tied):
            owned = [s for s in copies if s in self.it.reduced and (t, s) not in self.it.tie_given]
            if not owned:
                continue
            if t not in self.it.tied_grads:
                total = copies[owned[0]].grad.clone()
                for s in owned[1:]:
                    total += copies[s].grad
                self.reducer.tie(self.it.iteration, stages, total)
                self.it.tied_grads[t] = total
            for s in owned:
                copies[s].grad = self.it.tied_grads[t].clone()
                self.it.tie_given.add((t, s))

    def _grad_multiplier(self) -> float | None:
        """What this iteration's gradients are multiplied by before a step: the loss
        scale undone, clipped by the whole model's norm; None after an fp16 overflow
        anywhere (every copy of every stage then skips its step). Every stage's
        owner publishes its squared norm (a tied weight counted on its first stage
        only); the first to publish a stage wins, so a stage taken over after its
        owner died counts alike."""
        if not self.it.norms_read:
            for s in {i.stage for i in self.it.stream if i.op is Op.REDUCE_GRADS}:
                self.cluster.create(NORM(self.it.iteration, s), Loss(recipe.squared_norm(self._norm_params(s))))
            while len(norms := self.cluster.children(NORM(self.it.iteration))) < self.P:
                if not self.it.failover.keep_waiting():
                    raise Interrupted("a failure while waiting for the stages' gradient norms")
                time.sleep(0.01)
            squares = [n.value for n in norms.values()]
            self.it.multiplier = recipe.grad_multiplier(self.cfg.recipe, squares, self.it.loss_scale)
            self.it.norms_read, self.it.overflow = True, self.it.multiplier is None
        return self.it.multiplier

    def _norm_params(self, stage: int) -> list[torch.nn.Parameter]:
        skip = {id(copies[s]) for stages, copies in self.tied for s in stages[1:] if s in copies}
        return [p for p in self.modules[stage].parameters() if id(p) not in skip]

    def _prepare(self, stage: int) -> bool:
        """Tie, unscale and clip an owned stage's reduced gradients, once: its own
        step and its replica's sync (which may go first) use the same. False after
        an fp16 overflow anywhere (every copy of every stage then skips its step)."""
        if stage not in self.it.prepared:
            self._tie()
            multiplier = self._grad_multiplier() if self.cfg.recipe.grad_clip or self.cfg.recipe.loss_scaling else 1.0
            if multiplier is not None and multiplier != 1.0:
                recipe.scale_grads(self.modules[stage].parameters(), multiplier)
            self.it.prepared[stage] = multiplier is not None
        return self.it.prepared[stage]

    def optimizer_step(self, ins: Instr) -> None:
        if not ins.redundant and not self._prepare(ins.stage):
            self._keep_for_late_sync(ins.stage)  # an fp16 overflow: the sync goes, its step is skipped alike
            return
        if ins.redundant and self.late and self.overflowed_before:
            # a late sync's step is the iteration before's: skipped where that one overflowed
            self.modules[ins.stage].zero_grad(set_to_none=True)
            return
        if ins.redundant and self.cfg.recipe.loss_scaling and not self.late:
            self._tie()  # a replica's synced gradients are tied, unscaled and clipped already
            if self._grad_multiplier() is None:
                return
        if self.keep_undo and ins.stage not in self.it.undo:
            params = list(self.modules[ins.stage].parameters())
            state = self.optimizers[ins.stage].state
            self.it.undo[ins.stage] = ([p.detach().clone() for p in params],
                                    [{k: v.clone() if torch.is_tensor(v) else v for k, v in state.get(p, {}).items()}
                                     for p in params])
        if not ins.redundant:
            self._keep_for_late_sync(ins.stage)
        # a late sync's step is the iteration before's
        rate = recipe.learning_rate(self.cfg, self.it.iteration - (ins.redundant and self.late))
        if ins.redundant and self._defers_replica_steps():
            self.owed[ins.stage] = rate
            return
        recipe.set_learning_rate(self.optimizers[ins.stage], rate)
        self.optimizers[ins.stage].step()
        if ins.redundant and self.late:  # the synced gradients are spent: a BRC after it starts from zero
            self.modules[ins.stage].zero_grad(set_to_none=True)

    def _keep_for_late_sync(self, stage: int) -> None:
        """--replica-sync next: keep an owned stage's gradients as its step takes them,
        for its holder in the next iteration (schedules/syncs.py); auto's off epochs
        hold no replica. After an fp16 overflow they go all the same, so that every
        sync the streams hold is sent, and the holder skips their step (every node
        knows the iteration overflowed: `overflowed_before`)."""
        if self.late and self.it.failover.redundancy != Redundancy.OFF:
            self.kept_grads[stage] = recipe.flat_grads(sync_params(self.modules[stage]))
            if self.it.failover.loans is not None:  # lent in the next iteration, should a peer's owner die
                self.it.failover.loans.keep(KEPT, stage, self.it.iteration + 1, self.kept_grads[stage])

    def _defers_replica_steps(self) -> bool:
        """Lazy runs no replica in the fault-free path, and eager only in its FRC, so a
        replica's step can wait for the node's next wait (its linger, the boundary, the
        next iteration's first receive) or its first FRC instead of lengthening the
        iteration's tail: unless
        the step phase is shared (clipping, ties, fp16), steps may be undone (agents),
        or the replicas are compared after every step (--check-replicas)."""
        return (self.it.failover.redundancy in (Redundancy.LAZY, Redundancy.EAGER) and not self.step_after_reduces
                and not self.keep_undo and not self.cfg.testing.check_replicas)

    def settle_replicas(self) -> None:
        """Take the replica steps owed (each with its iteration's rate and synced
        gradients), before anything reads a replica."""
        for stage, rate in self.owed.items():
            recipe.set_learning_rate(self.optimizers[stage], rate)
            self.optimizers[stage].step()
            self.modules[stage].zero_grad(set_to_none=True)
        self.owed.clear()

    def rollback(self) -> None:
        """Undo this iteration's optimizer steps (an aborted iteration is redone)."""
        if self.it is None:
            return
        for stage, (values, states) in self.it.undo.items():
            optimizer = self.optimizers[stage]
            for p, value, state in zip(self.modules[stage].parameters(), values, states):
                with torch.no_grad():
                    p.copy_(value)
                if state:
                    optimizer.state[p] = state
                else:
                    optimizer.state.pop(p, None)
        self.it.undo = {}

    def _sync_early(self, ins: Instr) -> None:
        """Before stage s's last backward of the stream: post its sync in buckets as that
        backward fills them (bamboo/runtime/sync.py), when nothing changes the gradients
        after it (one pipeline; no clipping, ties or fp16), the stage is more than one
        bucket (else there is nothing to post early, and no hook is paid for), and
        no other sync goes first on the channel."""
        s, rest, size = ins.stage, self.it.stream[self.it.pc + 1:], int(self.cfg.schedule.sync_bucket_mb * 2**20)
        if self.step_after_reduces or self.reducer.D != 1 or s in self.it.early_syncs:
            return
        if any(i.op in WEIGHT_GRADS and i.stage == s for i in rest):  # not the last: most backwards end here
            return
        if sum(p.numel() * p.element_size() for p in self.modules[s].parameters()) <= size:
            return
        sync = next((i for i in rest if i.op is Op.SEND_SYNC and i.stage == s), None)
        if sync is None or next(i for i in rest if i.op is Op.SEND_SYNC and i.peer == sync.peer) != sync:
            return
        peer = self.peer(sync.peer)
        # a part posted from a hook learns of an earlier failure later; the last, posted at
        # the SEND_SYNC instruction, raises it there like any send
        self.it.early_syncs[s] = EarlySync(s, sync.peer, self.modules[s], lambda t, note: self.it.comm.post(
            peer, Op.SEND_SYNC, t, note, later=note is not None), size)

    def _close_syncs(self) -> None:
        """No bucket's hook outlives its iteration (a stream cut short, an abort)."""
        for early in self.it.early_syncs.values():
            early.close()
        self.it.early_syncs = {}

    def send_sync(self, ins: Instr) -> None:
        if self.late:  # the iteration before's, kept at its step
            self._send(ins, Op.SEND_SYNC, self.kept_grads.pop(ins.stage))
            return
        self._prepare(ins.stage)  # the gradients as the owner's step will take them
        early = self.it.early_syncs.pop(ins.stage, None)
        if early is not None and early.peer == ins.peer:
            early.finish()  # its buckets went out during the backward: the rest, the last of them
            return
        if early is not None:
            early.close()  # its holder died since (a new plan): the whole sync goes to the new one
        self._send(ins, Op.SEND_SYNC, recipe.flat_grads(sync_params(self.modules[ins.stage])))

    def recv_sync(self, ins: Instr) -> None:
        """The sync's parts (one, or its buckets: bamboo/runtime/sync.py), kept across an
        interrupted wait, joined into the replica's gradients."""
        key = (ins.stage, ins.peer)  # parts from an owner that died since are not another's
        parts = self.it.sync_parts.setdefault(key, [])
        loans = self.it.failover.loans
        if self.late and loans is not None and ins.stage in loans.borrowed:  # lent by another pipeline's owner
            parts[:] = [(loans.borrowed.pop(ins.stage), None)]
        flat = receive(parts, lambda: self.it.comm.recv_noted(
            self.peer(ins.peer), Op.SEND_SYNC, self.it.failover.keep_waiting))
        del self.it.sync_parts[key]
        recipe.set_flat_grads(sync_params(self.modules[ins.stage]), flat)
