"""Moving between epochs, a part of the worker (bamboo/runtime/worker.py) kept apart:
wait for the agents' next configuration, get the layers it gives this node (from
live holders, their memory copies, or a checkpoint: bamboo/state/handover.py),
form its world group, and abandon an epoch that a death kept from starting.

`EpochMoves` is a base of `Worker`, whose __init__ sets every attribute these
methods read or set: cluster, cfg, node, holdings, checkpoints, copies, assignment,
failed, comm, epochs (a watch of assignment/ and drain/); `enter`, `_world` and `_lease_check` are the worker's."""
from __future__ import annotations

import hashlib
import sys

from bamboo.control.assignment import Assignment, Restore
from bamboo.control.exits import Parked, Released
from bamboo.control.protocol import ABORT, ABORTED, ASSIGNMENT, DONE, DRAIN, SCALE, Abort, LossScale, Mark, world_store
from bamboo.control.store import RendezvousAborted
from bamboo.state import handover
from bamboo.state.handover import HandoverFailed

# A wait for a stage or the next epoch reads etcd when its watch says an epoch (or a
# drain) was written, and at least this often (a standby sees the job's end by it).
EPOCH_POLL = 0.5


class EpochMoves:
    def _assigned(self) -> Assignment | None:
        """The newest assignment once it gives this node a stage. Until then the
        node is in standby, started and warm; it leaves when training is over."""
        assignment = self.cluster.latest_assignment()
        if self.node in assignment.members:
            return assignment
        if self.cluster.children(DONE(self.cfg.schedule.iterations - 1)):
            raise Released(f"node {self.node}: the job finished while it waited in standby")
        if self.cluster.get(DRAIN(self.node)) is not None:
            raise Parked(f"node {self.node} was asked to leave before it had a stage")
        return None

    def _next_epoch(self, after: int) -> Assignment:
        """The agents' next configuration after epoch `after`."""
        def newer():
            latest = self.cluster.latest_assignment()
            return latest if latest.epoch > after else None
        return self.cluster.wait_for(newer, timeout=self.cfg.faults.stall_timeout,
                                     what="the agents' next configuration", poll=EPOCH_POLL, changes=self.epochs)

    def _move_to(self, new: Assignment) -> int:
        """Enter `new` (layers move, the world group forms) and return the iteration
        it starts from. When a node dies on the way, no one enters: the agents are
        told, and the node moves to the epoch they write next instead."""
        # a restore or a handover blocks longer than an iteration
        self.cluster.hang_deadline(self.cfg.faults.hang_timeout)
        while True:
            old = self.cluster.get(ASSIGNMENT(new.layers_from)) if new.layers_from >= 0 else None
            try:
                self._move_layers(new, old)
            except HandoverFailed as e:
                new = self._abandon(new, e)
                continue
            self.failed = new.gone
            try:  # without a handover first (a restore from storage) a newcomer's worker may still be starting
                self.comm = self._world(world_store(new.epoch), new.start, starting=new.members)
                return new.start
            except (RendezvousAborted, RuntimeError) as e:  # RuntimeError: gloo's, a member died
                if not self.cfg.cluster.elastic:
                    raise
                new = self._abandon(new, e)

    def _abandon(self, epoch: Assignment, error: Exception) -> Assignment:
        """Epoch `epoch` cannot start (a node died while it formed): abandon its first
        iteration, as a failover would one no pipeline can finish, and wait for
        the agents' next epoch."""
        why = f"epoch {epoch.epoch} could not start: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        print(f"bamboo.runtime.worker: node {self.node}: {why}", file=sys.stderr, flush=True)
        # Once the agents wrote the next epoch this one is settled: a late abort
        # would abandon that epoch's first iteration for nothing.
        after = ASSIGNMENT(epoch.epoch + 1)
        self.cluster.create_unless(ABORT(epoch.start), Abort(why, self.node), after)
        self.cluster.create_unless(ABORTED(epoch.start, self.node), Mark(), after)
        return self._next_epoch(epoch.epoch)

    def _move_layers(self, new: Assignment, old: Assignment | None) -> None:
        """Get the layers this node needs in `new` (from their live holders, or from
        the checkpoint the agents chose), then take its place in `new`, or leave if
        it has none."""
        if new.restore in (Restore.CHECKPOINT, Restore.INITIAL):
            received = {}
            if new.restore == Restore.INITIAL:
                self.holdings.drop()  # built again from the seed, as at the job's start
            elif self.node in new.members:
                blobs = self.checkpoints.taken_before(new.start)
                received = {i: blobs[i] for i in self.holdings.needs(new, self.node)}
                self._restore_loss_scale(new.start)
        else:  # from the live nodes' layers, or ("memory") from the checkpoint copies they keep
            received = handover.exchange(self.cluster, self.node, self.holdings, new, old,
                                         lambda members, starting: self._lease_check(members, new.start, starting),
                                         self.cfg.faults.hang_timeout,
                                         self.copies if new.restore == Restore.MEMORY else None)
            if new.restore == Restore.MEMORY and self.node in new.members:
                received = self._checked_copies(new.start, received)
                self._restore_loss_scale(new.start, self.copies.loss_scale(new.start))
        if self.node not in new.members:
            self.checkpoints.wait()
            self.copies.drop()  # the worker leaves: its copies with it
            raise Parked(f"node {self.node} has no stage in epoch {new.epoch}")  # back to standby
        self.enter(new, received)

    def _checked_copies(self, start: int, received: dict[int, bytes]) -> dict[int, bytes]:
        """Copies from peers' memory (over gloo, unauthenticated) checked against the
        hashes of the committed checkpoint they copy, where it is committed already:
        a layer that differs is read from storage instead."""
        hashes = self.checkpoints.hashes(start)
        bad = sorted(i for i, data in received.items()
                     if i in hashes and hashlib.sha256(data).hexdigest() != hashes[i])
        if not bad:
            return received
        print(f"bamboo.runtime.worker: node {self.node}: the copies of layers {bad} differ from the checkpoint "
              f"taken before iteration {start}: read from storage instead", file=sys.stderr, flush=True)
        stored = self.checkpoints.taken_before(start)
        return {**received, **{i: stored[i] for i in bad}}

    def _restore_loss_scale(self, start: int, kept: dict | None = None) -> None:
        """A restart from the checkpoint taken before `start`: the loss scale record
        stored with it (or `kept` with its copies in memory), unless the job's etcd
        still has that iteration's."""
        if self.cfg.recipe.loss_scaling and start > 0:
            found = kept or self.checkpoints.loss_scale(start)
            if found is None:
                raise RuntimeError(f"the checkpoint taken before iteration {start} has no loss scale (not fp16?)")
            self.cluster.create(SCALE(start - 1), LossScale.from_dict(found))

