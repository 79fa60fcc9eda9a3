"""What a stream must respect, one small function per invariant, chosen from the
schedule's options: the engine (schedules/timing/engine.py) asks the checks of `Checks.by_op`
whether an instruction may start, `on_execute` as it runs, and `at_end` when every node
stopped. A broken check raises a ValidationError whose text ends with the
timeline so far, the offending instruction marked.

Before an instruction: its inputs exist on the node (layers, loaded data,
activations, gradients, resident forward state), nothing is computed on a stage
after its reduce or step, sends have something to send, a step has gradients.
At its execution: a reduce sums every microbatch exactly once. At the end: no
message left unreceived, each stage reduced once and stepped on its owner and
replica holder, no forward state left resident, FRC for every microbatch when it
is expected, and no normal forward computed twice (an evaluation instead: every
(stage, microbatch) forward once, on the owner).
"""
from __future__ import annotations

from collections import Counter

from schedules.ir import Instr, Op
from schedules.layout import ScheduleError

COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
SHOWN_STEPS = 16  # the timeline of a broken check shows each node's last steps


class ValidationError(ScheduleError):
    """A stream that cannot run: `kind` is deadlock, out-of-order, use-before-produce,
    unmatched, exactly-once, not-stepped, leak, missing-frc, or frc-delay (an FRC
    that lengthens the fault-free iteration under --frc bubbles: bubbles.py).
    `timeline`, when the engine found it, shows what each node ran up to there."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.timeline = ""

    def __str__(self) -> str:
        return super().__str__() + (f"\n{self.timeline}" if self.timeline else "")


def timeline(done: dict[int, list[Instr]], marked: dict[int, Instr]) -> str:
    """A grid, a column per node and a row per step: what each node ran, in order,
    then the instruction that broke a check (or that a node blocked at) marked
    `>> ... <<`. About SHOWN_STEPS rows are shown: those up to the marks, else the last."""
    columns = {n: [str(i) for i in done[n]] + ([f">> {marked[n]} <<"] if n in marked else [])
               for n in sorted(done)}
    rows = max((len(c) for c in columns.values()), default=0)
    at = [len(done[n]) for n in marked if n in done]
    first = max(0, (min(at) if at else rows) - SHOWN_STEPS + (4 if at else 0))
    last = min(rows, max(at) + 4) if at else rows
    width = {n: max([len(f"node {n}"), *(len(x) for x in c[first:last])]) for n, c in columns.items()}
    head = "step | " + " | ".join(f"node {n}".ljust(width[n]) for n in columns)
    lines = [head, "-" * len(head)] + ([f" ... {first} steps before"] if first else [])
    for r in range(first, last):
        cells = (c[r] if r < len(c) else "" for c in columns.values())
        lines.append(f"{r:>4} | " + " | ".join(x.ljust(width[n]) for n, x in zip(columns, cells)))
    return "\n".join(line.rstrip() for line in lines + ([f" ... {rows - last} steps after"] if last < rows else []))


class Checks:
    """The invariants of one engine run, chosen by its options: `expect_frc` (False
    for streams before the FRC pass), `evaluation` (forward-only: nothing kept or
    stepped), `late_sync` (each replica's sync is the iteration before's:
    schedules/syncs.py) and `expect_syncs` (False before the late syncs are placed)."""

    def __init__(self, engine, expect_frc: bool = True, evaluation: bool = False, late_sync: bool = False,
                 expect_syncs: bool = True):
        self.engine = engine
        self.expect_frc, self.evaluation = expect_frc, evaluation
        self.late_sync, self.expect_syncs = late_sync, expect_syncs
        compute = (self._not_after_reduce_late, self._replica_synced_first) if late_sync else \
            (self._not_after_reduce_or_step,)
        self.by_op = {
            Op.LOAD: (self._loaded_once,),
            Op.FORWARD: (*compute, self._forward_inputs),
            Op.BACKWARD: (*compute, self._backward_inputs),
            Op.BACKWARD_INPUT: (*compute, self._backward_inputs),
            Op.BACKWARD_WEIGHT: (*compute, self._input_pass_before),
            Op.SEND_ACT: (self._has_activation,),
            Op.SEND_GRAD: (self._has_gradient,),
            Op.SWAP_OUT: (self._resident,),
            Op.SWAP_IN: (self._swapped,),
            Op.REDUCE_GRADS: (self._reduced_once,),
            Op.SEND_SYNC: (self._sync_before_reduce,) if late_sync else (self._sync_after_reduce,),
            Op.OPTIMIZER_STEP: (self._step_has_gradients,),
        }

    # -- before an instruction (by_op): why it cannot start, or nothing ---------------
    @staticmethod
    def _loaded_once(node, st, ins):
        return ins.mb in st.loaded and f"microbatch {ins.mb} loaded twice"

    @staticmethod
    def _not_after_reduce_or_step(node, st, ins):
        s = ins.stage
        return (s in st.reduced or (s, True) in st.stepped) and \
            f"stage {s} computes after its gradients were reduced or its step was taken"

    @staticmethod
    def _not_after_reduce_late(node, st, ins):
        return ins.stage in st.reduced and \
            f"stage {ins.stage} computes after its gradients were reduced or its step was taken"

    def _replica_synced_first(self, node, st, ins):
        s = ins.stage
        return s == self.engine.layout.replica(node) and (s, True) not in st.stepped and \
            f"stage {s} computed on its replica before it took the sync of the iteration before"

    def _forward_inputs(self, node, st, ins):
        s, mb, P = ins.stage, ins.mb, self.engine.P
        if s not in st.layers:
            return f"does not hold the layers of stage {s}"
        if (s == 0 or s == P - 1) and mb not in st.loaded:
            return f"microbatch {mb} not loaded"
        if s > 0 and (s - 1, mb) not in st.acts:
            return f"no input activation (stage {s - 1}, mb {mb})"
        return (s, mb) in st.states and f"forward state (stage {s}, mb {mb}) computed twice"

    def _backward_inputs(self, node, st, ins):
        s, mb = ins.stage, ins.mb
        if s not in st.layers:
            return f"does not hold the layers of stage {s}"
        if st.states.get((s, mb)) is not True:
            return f"no resident forward state (stage {s}, mb {mb})"
        return s < self.engine.P - 1 and (s + 1, mb) not in st.grads and \
            f"no output gradient (stage {s + 1}, mb {mb})"

    @staticmethod
    def _input_pass_before(node, st, ins):
        return st.states.get((ins.stage, ins.mb)) != "weights" and \
            f"no input gradient's pass before (stage {ins.stage}, mb {ins.mb})"

    @staticmethod
    def _has_activation(node, st, ins):
        return (ins.stage, ins.mb) not in st.acts and f"no activation (stage {ins.stage}, mb {ins.mb}) to send"

    @staticmethod
    def _has_gradient(node, st, ins):
        return (ins.stage, ins.mb) not in st.grads and f"no gradient (stage {ins.stage}, mb {ins.mb}) to send"

    @staticmethod
    def _resident(node, st, ins):
        return st.states.get((ins.stage, ins.mb)) is not True and \
            f"nothing resident to swap out ({ins.stage}, {ins.mb})"

    @staticmethod
    def _swapped(node, st, ins):
        return st.states.get((ins.stage, ins.mb)) is not False and \
            f"nothing swapped out to swap in ({ins.stage}, {ins.mb})"

    @staticmethod
    def _reduced_once(node, st, ins):
        return ins.stage in st.reduced and f"stage {ins.stage} reduced twice"

    @staticmethod
    def _sync_before_reduce(node, st, ins):
        return ins.stage in st.reduced and \
            f"stage {ins.stage}: the sync of the iteration before sent after this one's reduce"

    @staticmethod
    def _sync_after_reduce(node, st, ins):
        return ins.stage not in st.reduced and f"stage {ins.stage} synced before it was reduced"

    @staticmethod
    def _step_has_gradients(node, st, ins):
        ready = st.synced if ins.redundant else st.reduced
        return (ins.stage not in ready or (ins.stage, ins.redundant) in st.stepped) and \
            f"stage {ins.stage} stepped without gradients"

    # -- as an instruction runs -------------------------------------------------------
    def on_execute(self, node: int, st, ins: Instr) -> None:
        if ins.op is Op.REDUCE_GRADS:
            counts = Counter(st.accum[ins.stage])
            lost = [mb for mb in range(self.engine.M) if counts[mb] == 0]
            twice = sorted(mb for mb, c in counts.items() if c > 1)
            if lost or twice:
                raise ValidationError("exactly-once", f"node {node} reduces stage {ins.stage} with microbatches "
                                      f"missing {lost} and counted twice {twice}")

    # -- at the end -------------------------------------------------------------------
    def at_end(self, live: list[int]) -> None:
        self._no_message_left()
        if self.evaluation:
            self._evaluation_forwards_once()
            return
        eng = self.engine
        final = eng.layout if eng.dead_node is None else eng.layout.with_failed(eng.dead_node)
        reducers = Counter(s for n in live for s in eng.nodes[n].reduced)
        for s in range(eng.P):
            self._reduced_once_in_all(s, reducers[s])
            self._stepped_everywhere(s, final)
        for n in live:
            self._no_state_left(n)
            if self.expect_frc:
                self._frc_for_every_microbatch(n, final)
        self._normal_forwards_once()

    def _no_message_left(self) -> None:
        eng = self.engine
        for (src, dst, _), q in eng.channels.items():
            if q and eng.dead_node not in (src, dst):
                raise ValidationError("unmatched", f"node {src} sent {q[0][0]} to node {dst}, never received")

    @staticmethod
    def _reduced_once_in_all(s: int, reducers: int) -> None:
        if reducers > 1:
            raise ValidationError("exactly-once", f"stage {s} reduced on {reducers} nodes")

    def _stepped_everywhere(self, s: int, final) -> None:
        eng = self.engine
        owner, holder = final.owner(s), final.holder(s)
        if self.late_sync:  # the syncs in the streams are to the holders the iteration began with
            holder = eng.layout.holder(s) if eng.layout.holder(s) != eng.dead_node else None
        if not eng.nodes[owner].stepped & ({(s, False)} if self.late_sync else {(s, False), (s, True)}):
            raise ValidationError("not-stepped", f"stage {s} never stepped on its owner, node {owner}")
        if holder is not None and self.expect_syncs and (s, True) not in eng.nodes[holder].stepped:
            raise ValidationError("not-stepped", f"replica of stage {s} on node {holder} never stepped")

    def _no_state_left(self, n: int) -> None:
        left = sorted(k for k, resident in self.engine.nodes[n].states.items() if resident)
        if left:
            raise ValidationError("leak", f"node {n} ends with forward state {left[0]} still resident")

    def _frc_for_every_microbatch(self, n: int, final) -> None:
        r = final.replica(n)
        missing = [mb for mb in range(self.engine.M) if r is not None and (r, mb) not in self.engine.nodes[n].frc]
        if missing:
            raise ValidationError("missing-frc", f"node {n} never ran FRC of stage {r} for microbatch {missing[0]}")

    def _normal_forwards_once(self) -> None:
        twice = sorted(k for k, c in self.engine.normal_forwards.items() if c > 1)
        if twice:
            raise ValidationError("exactly-once", f"forward (stage, mb) {twice[0]} computed twice as normal work")

    def _evaluation_forwards_once(self) -> None:
        """Every (stage, mb) forwarded exactly once, by the stage's owner."""
        eng = self.engine
        for s in range(eng.P):
            owner = eng.nodes[eng.layout.owner(s)]
            for mb in range(eng.M):
                if eng.normal_forwards[(s, mb)] != 1 or (s, mb) not in owner.acts:
                    raise ValidationError("exactly-once", f"evaluation forward (stage {s}, mb {mb}) ran "
                                          f"{eng.normal_forwards[(s, mb)]} times or not on its owner")
