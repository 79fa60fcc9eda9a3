"""Compute ahead: the next iteration's first forward runs while the boundary agrees.

Stage 0's owner is the last node of its pipeline to finish an iteration (1F1B's
drain), and the pipeline's next iteration waits for its first activation. Its
report and the agreement (a few etcd round trips, docs/HOTPATH.md) therefore lie
on the critical path. The next stream begins with LOAD and FORWARD, which need
nothing the boundary decides: the step was taken, the samples and the dropout
seeds follow from the iteration. So a thread runs them while the main thread
agrees, on a private IterationState, and the next iteration takes their results
if its stream begins with the same instructions for the same samples; otherwise
(a death changed the pipeline, the agents reconfigure, the iteration is
abandoned) they are dropped. Nothing is sent before the agreement.

Opt-in (--compute-ahead): on this project's 2-core machine it measured no faster,
the forward's Python holding the GIL the boundary's etcd client needs, and each
iteration's thread added to the peak memory (docs/HOTPATH.md). CPU only: on CUDA
the forward's time is kernel launches that overlap anyway, and what runs on which
stream from a second thread was never checked on a GPU."""
from __future__ import annotations

import copy
import threading
import time

from schedules.ir import Instr, Op

from bamboo.runtime.iteration import IterationState

# What a thread may run ahead: local compute whose inputs the agreement cannot change.
AHEAD_OPS = frozenset({Op.LOAD, Op.FORWARD})


def prefix_ahead(stream: list[Instr]) -> list[Instr]:
    """The stream's leading loads and forwards (not FRC's redundant ones, whose saved
    tensors go to host memory): empty unless a forward is among them, which only a
    stream that begins at stage 0 has."""
    prefix = []
    for ins in stream:
        if ins.op not in AHEAD_OPS or ins.redundant:
            break
        prefix.append(ins)
    return prefix if any(i.op is Op.FORWARD for i in prefix) else []


class Ahead:
    """`prefix` of iteration `iteration`'s `stream`, run by `executor`'s op methods (`ops`) on
    a thread of its own, into a state of its own (a shallow copy of the executor
    shares its modules, corpus and device, not its iteration)."""

    def __init__(self, executor, ops: dict, iteration: int, stream: list[Instr], prefix: list[Instr],
                 microbatches: range):
        self.ops, self.iteration, self.prefix, self.microbatches = ops, iteration, list(prefix), microbatches
        self.shadow = copy.copy(executor)
        self.shadow.it = IterationState(iteration, microbatches, comm=None, failover=None, stream=stream)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"ahead-{iteration}")
        self.thread.start()

    def _run(self) -> None:
        try:
            for pc, ins in enumerate(self.prefix):
                self.shadow.it.pc = pc
                began = time.monotonic()
                self.ops[ins.op](self.shadow, ins)
                self.shadow.it.busy += time.monotonic() - began
        except BaseException as e:  # raised where the results are taken
            self.error = e

    def join(self) -> None:
        self.thread.join()

    def take(self, it: IterationState, stream: list[Instr]) -> int:
        """Move the results into `it` if `stream` begins with what ran, for the same
        iteration and samples; return how many of its instructions ran (0: dropped).
        The thread's error is raised here, unless its work was not wanted anyway."""
        self.join()
        n = len(self.prefix)
        if (it.iteration, it.mbs) != (self.iteration, self.microbatches) or stream[:n] != self.prefix:
            return 0
        if self.error is not None:
            raise self.error
        ran = self.shadow.it
        it.inputs.update(ran.inputs)
        it.labels.update(ran.labels)
        it.drawn.update(ran.drawn)
        it.states.update(ran.states)
        it.acts.update(ran.acts)
        it.busy += ran.busy
        return n
