"""`--preempt` specs: NODE@ITER[:[eval]INSTR] or `random`, checked against the
streams the compiler gives the node, so a kill that could never fire is refused
before the job starts."""
from __future__ import annotations

import random

from bamboo.control.config import Preempt, evaluated
from schedules.options import JobRedundancy, JobReplicaSync, Redundancy, ReplicaSync, ScheduleOptions


def stream_mode(args) -> str:
    """The mode whose streams --preempt positions count in: with auto, eager's (the
    longest; the mode running at that iteration may be another)."""
    return Redundancy.EAGER if args.redundancy == JobRedundancy.AUTO else args.redundancy


def fault_free_stream(args, node: int, first: bool = False) -> list:
    """Node `node`'s instruction stream in an iteration without failures (`first`:
    a run's first, which owes no sync with --replica-sync next)."""
    from schedules.compiler import compile_schedule

    from bamboo.data.corpus import split_microbatches

    m = len(split_microbatches(args.microbatches, args.pipelines)[node // args.stages])
    sync = ReplicaSync.NONE if first and args.replica_sync == ReplicaSync.NEXT else args.replica_sync
    sync = ReplicaSync.END if sync == JobReplicaSync.AUTO else sync  # the agents' first choice is unknown here
    options = ScheduleOptions(redundancy=stream_mode(args), frc=args.frc, sync=sync, split=args.backward_split,
                              ahead=args.compute_ahead)
    return compile_schedule(args.stages, m, (), options).streams[node % args.stages]


def random_preempt(args, rng: random.Random) -> Preempt:
    """A node, an iteration after the first, and an instruction before the node's
    data-parallel reduce (a death after it is not survivable inside the iteration),
    and with --replica-sync next after its sync of the iteration before (ditto)."""
    node = rng.randrange(args.stages * args.pipelines)
    stream = fault_free_stream(args, node)
    reduce_at = next(i for i, ins in enumerate(stream) if ins.op.value == "reduce_grads")
    first = 1 if args.replica_sync == ReplicaSync.NEXT else 0
    return Preempt(node, rng.randrange(1, max(2, args.iterations)), rng.randrange(first, reduce_at))


def parse_spec(spec: str) -> Preempt:
    """NODE@ITERATION[:[eval]INSTRUCTION] as a Preempt, or a ValueError naming the spec."""
    try:
        node, _, rest = spec.partition("@")
        it, _, ins = rest.partition(":")
        phase = "eval" if ins.startswith("eval") else "train"
        return Preempt(int(node), int(it), int(ins.removeprefix("eval") or 0), phase)
    except ValueError:
        raise ValueError(f"--preempt {spec!r}: expected NODE@ITERATION[:[eval]INSTRUCTION] or 'random'") from None


def parse_preempts(specs: list[str], args) -> tuple[Preempt, ...]:
    nodes = args.stages * args.pipelines
    if args.local_nodes is not None:
        nodes = args.local_nodes + sum(int(j.partition("@")[0]) for j in args.join if j.partition("@")[0].isdigit())
    rng = random.Random(args.seed)
    out = []
    for spec in specs:
        if spec == "random":
            out.append(random_preempt(args, rng))
            continue
        p = parse_spec(spec)
        if not 0 <= p.node < nodes:
            raise ValueError(f"--preempt {spec!r}: node {p.node} is out of range 0..{nodes - 1}")
        if not 0 <= p.iteration < args.iterations:
            raise ValueError(f"--preempt {spec!r}: iteration {p.iteration} is out of range "
                             f"0..{args.iterations - 1} (it would never fire)")
        length = len(preempted_stream(args, p, spec))
        if not 0 <= p.instruction <= length:
            raise ValueError(f"--preempt {spec!r}: node {p.node} runs {length} instructions "
                             f"{'an evaluation' if p.phase == 'eval' else 'an iteration'} "
                             f"(0..{length} allowed; {length} is after the last)")
        out.append(p)
    return tuple(out)


def preempted_stream(args, p: Preempt, spec: str) -> list:
    """The fault-free stream a --preempt counts instructions in: the node's training
    stream, or its evaluation stream after an evaluated iteration's step."""
    node = p.node % (args.stages * args.pipelines)
    if p.phase == "train":
        return fault_free_stream(args, node, first=p.iteration == 0)
    from schedules.compiler import compile_eval

    from bamboo.data.corpus import split_microbatches

    m = len(split_microbatches(args.eval_batches, args.pipelines)[node // args.stages])
    if not evaluated(p.iteration, args.eval_every, args.iterations) or not m:
        raise ValueError(f"--preempt {spec!r}: node {p.node} evaluates nothing after iteration {p.iteration} "
                         f"(--eval-every {args.eval_every}, --eval-batches {args.eval_batches})")
    return compile_eval(args.stages, m, (), stream_mode(args)).streams[node % args.stages]
