"""The validator's rule for bounded eager (`--frc bubbles`): FRC only fills idle time.

A redundant forward costs nothing only while its node would otherwise wait. So
under the cost model the FRC was placed with, the iteration must end no later
than the same streams without FRC, and every instruction those streams run must
start no later, except the replica's sync and step that end a node's stream:
nothing waits for them, so they may move into the time the node would idle
until the iteration's end. The streams without FRC are timed on their own here,
not taken from the placement's arithmetic of gaps, so a placement that put an
FRC in a wait too short for it is caught. (The instructions FRC brings are its
forward, its swap-out, and a load it moved earlier, which only makes what
follows start sooner.)
"""
from __future__ import annotations

from schedules.timing.checks import ValidationError
from schedules.cost import CostModel
from schedules.timing.fast import finish_time, start_times
from schedules.ir import Instr, Op

RELATIVE_TOLERANCE = 1e-7  # of the iteration's length: float sums of the gaps, not a real delay


def makespan(streams: dict[int, list[Instr]], starts: dict[int, list[float]], cost: CostModel) -> float:
    """When the last node ends its stream, given each instruction's start."""
    return max((starts[n][-1] + cost.duration(s[-1]) for n, s in streams.items() if s), default=0.0)


def timed_makespan(streams: dict[int, list[Instr]], cost: CostModel) -> float:
    """When the last node ends, timed by the fast pass (schedules/timing/fast.py, no
    checks): for streams valid by construction, the compiler's candidates and the
    schedules it built."""
    return finish_time(streams, cost)


def _kept(stream: list[Instr]) -> list[int]:
    """Positions of the instructions a stream runs with or without FRC, bar the
    loads (FRC may move a load earlier, which delays nothing)."""
    skip, forward = (Op.LOAD, Op.SWAP_OUT), Op.FORWARD
    return [i for i, ins in enumerate(stream) if ins.op not in skip and not (ins.redundant and ins.op is forward)]


def check_in_bubbles(plain: dict[int, list[Instr]], streams: dict[int, list[Instr]],
                     cost: CostModel) -> tuple[float, float]:
    """(makespan without FRC, with it); a ValidationError ("frc-delay") naming the
    first instruction FRC delays (the earliest: the others may only wait for it).
    `plain`: the same streams before FRC went in."""
    without, with_frc = start_times(plain, cost), start_times(streams, cost)
    length, length_frc = makespan(plain, without, cost), makespan(streams, with_frc, cost)
    tolerance = RELATIVE_TOLERANCE * max(1.0, length)
    delayed = []  # (start without FRC, node, instruction, start with FRC)
    for node, stream in streams.items():
        mine, theirs = _kept(stream), _kept(plain[node])
        if [stream[i] for i in mine] != [plain[node][i] for i in theirs]:
            raise ValidationError("frc-delay", f"node {node}: the stream is not its plain stream with FRC added")
        late = next(((without[node][j], node, stream[i], with_frc[node][i]) for i, j in zip(mine, theirs)
                     if with_frc[node][i] > without[node][j] + tolerance and not _replica_end(stream[i])), None)
        delayed += [late] if late else []
    if delayed:
        before, node, ins, start = min(delayed)
        raise ValidationError("frc-delay", f"node {node}: {ins} starts at {start:.9g} with FRC, at {before:.9g} "
                              "without: an FRC before it does not fit its wait")
    if length_frc > length + tolerance:
        raise ValidationError("frc-delay", f"the iteration ends at {length_frc:.9g} with FRC, at {length:.9g} "
                              "without: FRC lengthens it")
    return length, length_frc


def _replica_end(ins: Instr) -> bool:
    """The replica's sync and step: the last of a node's stream, awaited by nobody."""
    return ins.op is Op.RECV_SYNC or (ins.op is Op.OPTIMIZER_STEP and ins.redundant)
