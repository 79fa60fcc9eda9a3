"""A stage's gradients lent by its owner in another pipeline, for a death in a late
sync's window (--replica-sync next, two pipelines or more).

An owner that dies before its sync of the iteration before has landed leaves its
holder's replica a step behind; one that dies after its data-parallel reduce took
its pipeline's share into the other pipelines' sums, which its holder cannot
recompute (`windows` in schedules/syncs.py). Every other pipeline's owner of the
stage holds what is missing, the same to the bit: the gradients it stepped with in
the iteration before (kept for its own holder's sync) and this iteration's reduced
sum. So the holder asks one (LOAN), which answers (LENT) and sends the tensor over
the world group, and the iteration goes on as if the sync had landed or the reduce
had returned: nothing is redone. A lender serves in its waits (each look of its
failover, its linger, the boundary), and reads the asks only once a node died in
the iteration: the fault-free path reads nothing more from etcd. What it costs is
memory: the kept gradients live to the end of the iteration after their step, not
to their send, and with clipping or fp16 the reduced sum is copied before its scaling.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from bamboo.control.assignment import Assignment
from bamboo.control.cluster import Cluster
from bamboo.control.protocol import LENT, LOAN, LOANS, Lent, Loan, NodeId
from bamboo.transport.comm import Comm
from schedules.ir import Instr, Op
from schedules.layout import Layout, ScheduleError

KEPT, REDUCED_SUM = LOANS  # the gradients stepped with in the iteration before; this iteration's sum
TAG = 16  # gloo tags from here on, one per (stage, loan): apart from the channels' (bamboo/transport/comm.py)
ASK_EVERY = 0.01  # seconds between a borrower's reads of the answer, and looks at its wait


def tag(stage: int, what: str) -> int:
    return TAG + len(LOANS) * stage + LOANS.index(what)


class NoLender(RuntimeError):
    """No other pipeline's owner of the stage could lend what was asked."""


class Loans:
    def __init__(self, cluster: Cluster, assignment: Assignment, me: NodeId, modules: dict[int, torch.nn.Module],
                 replicas: bool, copies: bool):
        """`modules`: this node's stages and replica, by stage (what a loan's size and
        device are); `replicas`: the epoch's mode keeps them (else nobody borrows);
        `copies`: steps scale the reduced gradients in place (clipping, fp16), so a
        sum to lend is copied first."""
        self.cluster, self.assignment, self.me, self.modules = cluster, assignment, me, modules
        self.lends = replicas and len(assignment.pipelines) > 1  # with one pipeline nobody could
        self.copies = copies
        self.iteration = -1
        self.comm: Comm | None = None
        self.held: dict[tuple[str, int, int], torch.Tensor] = {}  # (loan, stage, iteration asked in) -> tensor
        self.answered: set[tuple[NodeId, int, str]] = set()  # (borrower, stage, loan) answered this iteration
        self.borrowed: dict[int, torch.Tensor] = {}  # replica stage -> its sync of the iteration before, lent
        self.last: tuple[NodeId, str, float] | None = None  # the last loan taken: lender, what, seconds
        self.done = False      # this node's stream ran to its end: a sum not held now never will be
        self.waiting = False   # an ask for a sum this node has yet to reduce is unanswered

    def begin(self, iteration: int, comm: Comm) -> None:
        """A new iteration: what was held for an earlier one is dropped."""
        self.iteration, self.comm = iteration, comm
        self.held = {k: t for k, t in self.held.items() if k[2] >= iteration}
        self.answered, self.borrowed, self.last = set(), {}, None
        self.done = self.waiting = False

    def keep(self, what: str, stage: int, iteration: int, tensor: torch.Tensor) -> None:
        """Hold `tensor` to lend in `iteration`: the kept gradients of a step, asked for
        in the next iteration; a reduced sum, in its own."""
        if self.lends:
            copy = what == REDUCED_SUM and self.copies
            self.held[(what, stage, iteration)] = tensor.clone() if copy else tensor
            if self.waiting:  # a peer asked for it before this node's own reduce ended
                self.serve()

    def serve(self) -> None:
        """Answer every ask for this node in this iteration not answered yet: send what
        it holds (over the world group, on the loan's own tag), else say it has none."""
        if not self.lends or self.comm is None:
            return
        self.waiting = False
        for borrower, loan in self.cluster.children(LOAN(self.iteration, self.me)).items():
            key = (NodeId(borrower), loan.stage, loan.what)
            if key in self.answered or loan.what not in LOANS or borrower not in self.comm.rank_of:
                continue
            tensor = self.held.get((loan.what, loan.stage, self.iteration))
            if tensor is None and loan.what == REDUCED_SUM and not self.done:
                self.waiting = True  # its own reduce of the stage may be still to end: answered then
                continue
            self.answered.add(key)
            if tensor is not None:
                lent = tensor.detach().to("cpu").contiguous()
                _in_background(self.comm.pg.send([lent], self.comm.rank_of[borrower], tag(loan.stage, loan.what)),
                               lent)
            self.cluster.put(LENT(self.iteration, self.me, borrower), Lent(loan.stage, loan.what, tensor is not None))

    def lenders(self, stage: int, failed, mine: int) -> list[NodeId]:
        """The owners of `stage` in the other pipelines than `mine`, alive as `failed` says."""
        out = []
        for j, pipe in enumerate(self.assignment.pipelines):
            try:
                owner = pipe[Layout(self.assignment.depth, self.assignment.local_failed(j, failed)).owner(stage)]
            except ScheduleError:  # two neighbours dead there: it holds no copy
                continue
            if j != mine and owner not in failed:
                out.append(NodeId(owner))
        return out

    def late_sync(self, dead: list[Instr], me: int, counts: dict[str, int], pipeline: int,
                  alive: Callable[[NodeId], bool]) -> dict[str, int]:
        """`counts` of what this node received from a dead owner whose stream was
        `dead`, its sync of the iteration before counted as landed once borrowed
        from another pipeline's owner of its stage, when it had not (the recovery
        then runs as if it had, and the executor's receive takes the loan)."""
        sync = next((i for i in dead if i.op is Op.SEND_SYNC and i.peer == me), None)
        if sync is None or not self.lends or counts.get(Op.SEND_SYNC.value, 0):
            return counts
        try:
            self.borrowed[sync.stage] = self.borrow(KEPT, sync.stage, pipeline, alive)
        except NoLender:
            return counts  # the cut says it had not landed: not survivable in the iteration, by name
        return {**counts, Op.SEND_SYNC.value: 1}

    def borrow(self, what: str, stage: int, pipeline: int, alive: Callable[[NodeId], bool]) -> torch.Tensor:
        """Stage `stage`'s flat gradients (`what`), as the first of its owners in the
        other pipelines than `pipeline` that holds them lends them, on this node's
        device. `alive(node)` is asked while waiting (it may raise: an abort);
        NoLender when none could lend them."""
        began, lenders = time.monotonic(), self.lenders(stage, self.cluster.failed(), pipeline)
        params = list(self.modules[stage].parameters())
        size = sum(p.numel() for p in params)
        for lender in lenders:
            self.cluster.put(LOAN(self.iteration, lender, self.me), Loan(stage, what))
            answer = self._answer(lender, stage, what, alive)
            if answer is None or not answer.sent:
                continue
            flat = torch.empty(size, dtype=params[0].dtype)
            work = self.comm.pg.recv([flat], self.comm.rank_of[lender], tag(stage, what))
            if self._arrived(work, lender, alive):
                self.last = (lender, what, round(time.monotonic() - began, 4))
                return flat.to(params[0].device)
        raise NoLender(f"no other pipeline's owner of stage {stage} could lend its {what} gradients "
                       f"(asked: {lenders or 'none alive'})")

    def _answer(self, lender: NodeId, stage: int, what: str, alive) -> Lent | None:
        """The lender's answer (None: it died first). Meanwhile this node serves: the
        lender may be borrowing from it (two pipelines each lost a stage's owner)."""
        while alive(lender):
            answer = self.cluster.get(LENT(self.iteration, lender, self.me))
            if answer is not None and (answer.stage, answer.what) == (stage, what):
                return answer
            self.serve()
            self.cluster.progress()
            time.sleep(ASK_EVERY)
        return None

    def _arrived(self, work, lender: NodeId, alive) -> bool:
        """Whether the receive `work` completed (False: its lender died first; the
        receive stays posted in a world the boundary replaces)."""
        done = _in_background(work)
        while not done.wait(ASK_EVERY):
            if not alive(lender):
                return False
            self.serve()
        return done.ok


class _Waited(threading.Event):
    ok = False  # the work completed without an error


def _in_background(work, *keep) -> _Waited:
    """Wait for a gloo send or receive on a thread of its own (their `is_completed`
    says False until someone waited), holding `keep` (what it sends) until then."""
    done = _Waited()

    def wait(*held) -> None:  # `held`: the thread's arguments live as long as it runs
        try:
            work.wait()
            done.ok = True
        except RuntimeError:  # the peer's pair closed, or the group's timeout
            pass
        done.set()
    threading.Thread(target=wait, args=keep, daemon=True, name="loan").start()
    return done
