"""Compute ahead: the next iteration's first forwards run while the boundary agrees.

The pipeline's next iteration waits for stage 0's first activation, and stage 0's
owner computes it only after the boundary: after the last stage's tail (with split
backwards, its weight passes and step, which stage 0 waits through) and the
agreement (a few etcd round trips, docs/HOTPATH.md). The next stream begins, after
its late syncs if any, with loads, forwards and their sends (`prefix_ahead`,
schedules/overlap.py); the loads and forwards need nothing the boundary decides:
the step was taken, the samples and the dropout seeds follow from the iteration. So
a thread runs them from the moment the node's own stream has ended, while it waits
for its pipeline and agrees, on a private IterationState, and the next iteration
takes their results if its stream begins with the same instructions for the same
samples; otherwise (a death changed the pipeline, the agents reconfigure, the
iteration is abandoned) they are dropped. Nothing is sent before the agreement:
once it is in, the main thread posts each send as soon as the thread has run the
forward before it, while the thread runs on. The compiler gives such a run its own
order (schedules/overlap.py): stage 0 begins with more forwards, and the last
stage's tail holds more weight passes, so that the forwards run ahead fill the last
stage's wait.

Opt-in (--compute-ahead): each iteration's thread adds to the peak memory, and so
does the order (a microbatch's activations per extra forward, a microbatch's graph
per weight pass held back; docs/HOTPATH.md). CPU only: on CUDA the forward's time
is kernel launches that overlap anyway, and what runs on which stream from a
second thread was never checked on a GPU."""
from __future__ import annotations

import copy
import threading
import time

from schedules.ir import Instr
from schedules.overlap import AHEAD_OPS, leading_syncs

from bamboo.runtime.iteration import IterationState
from bamboo.transport.comm import PeerFailure


class Ahead:
    """`prefix` of iteration `iteration`'s `stream`, its loads and forwards run by
    `executor`'s op methods (`ops`) on a thread of its own, into a state of its own (a
    shallow copy of the executor shares its modules, corpus and device, not its
    iteration). `ran` counts the prefix's instructions behind the thread."""

    def __init__(self, executor, ops: dict, iteration: int, stream: list[Instr], prefix: list[Instr],
                 microbatches: range):
        self.ops, self.iteration, self.prefix, self.microbatches = ops, iteration, list(prefix), microbatches
        self.first = leading_syncs(stream)  # where the prefix begins in the stream
        self.shadow = copy.copy(executor)
        self.shadow.it = IterationState(iteration, microbatches, comm=None, failover=None, stream=stream)
        self.error: BaseException | None = None
        self.ran = 0
        self.progress = threading.Condition()
        self.cancelled = threading.Event()  # dropped: stop before the next instruction
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"ahead-{iteration}")
        self.thread.start()

    def _run(self) -> None:
        try:
            for k, ins in enumerate(self.prefix):
                if self.cancelled.is_set():
                    break
                if ins.op in AHEAD_OPS:
                    self.shadow.it.pc = self.first + k
                    began = time.monotonic()
                    self.ops[ins.op](self.shadow, ins)
                    self.shadow.it.busy += time.monotonic() - began
                with self.progress:
                    self.ran = k + 1
                    self.progress.notify_all()
        except BaseException as e:  # raised where the results are taken
            self.error = e
        finally:
            with self.progress:
                self.ran = len(self.prefix)
                self.progress.notify_all()

    def join(self) -> None:
        self.thread.join()

    def drop(self) -> None:
        """Stop the thread after the instruction it runs (a recovery waits for no more)."""
        self.cancelled.set()
        self.join()

    def take(self, it: IterationState, stream: list[Instr]) -> int:
        """How many of `stream`'s instructions, after its late syncs, ran ahead: the
        prefix's length if the stream begins with it for the same iteration and
        samples, else 0 (dropped, once the thread has ended)."""
        first, n = leading_syncs(stream), len(self.prefix)
        if (it.iteration, it.mbs) != (self.iteration, self.microbatches) or stream[first:first + n] != self.prefix:
            self.drop()
            return 0
        return n

    def activation(self, k: int):
        """The activation that the prefix's send `k` posts, once the thread has run
        everything before it (its error raised here)."""
        with self.progress:
            self.progress.wait_for(lambda: self.ran >= k)
        if self.error is not None:
            raise self.error
        ins = self.prefix[k]
        return self.shadow.it.acts[(ins.stage, ins.mb)]

    def post(self, executor, stream: list[Instr], pc: int, failover) -> int:
        """The main thread's part, once the agreement is in: the prefix from `pc` on in
        `executor`'s iteration, each send posted as soon as the thread has run the
        forward before it, the thread's results taken at the end; where the stream goes on."""
        try:
            for k, ins in enumerate(self.prefix):
                executor.it.stream, executor.it.pc = stream, pc + k
                executor._maybe_preempt(pc + k)
                if ins.op in AHEAD_OPS:
                    continue
                executor.it.acts[(ins.stage, ins.mb)] = self.activation(k)
                try:
                    executor._execute(ins)
                except PeerFailure as e:  # lost with the dead node, as any send to it
                    failover.detected(e.node, str(e))
        except BaseException:
            self.join()  # nothing runs on past what raised
            raise
        self.finish(executor.it)
        return pc + len(self.prefix)

    def finish(self, it: IterationState) -> None:
        """Wait for the thread and move its results into `it` (its error raised here)."""
        self.join()
        if self.error is not None:
            raise self.error
        ran = self.shadow.it
        it.inputs.update(ran.inputs)
        it.labels.update(ran.labels)
        it.drawn.update(ran.drawn)
        it.states.update(ran.states)
        it.acts.update(ran.acts)
        it.busy += ran.busy
