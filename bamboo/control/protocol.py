"""The control plane's protocol: every etcd key a job uses, and the record each holds.

A key family is a name and the integer parts that follow it (`DONE(it, node)` is
the key of node's report on iteration it; `DONE(it)` the prefix of all of them);
its value is one record type, written as JSON. Nothing outside this module spells
a key. All keys live under /bamboo/<job>/, except the agents' first rendezvous,
under /bamboo-rdzv/<job>/.

The workers' half, one iteration at a time:
  1. register ALIVE under a lease; wait for an ASSIGNMENT that gives the node a
     stage; the first epoch's nodes publish START
  2. the last stage's owner, when its stream ends: every microbatch's LOSS, with its
     FINISHED mark (each loss also rides with its gradient); with several
     pipelines, before its reduce; after the step of an evaluated iteration, per
     validation microbatch: VAL_LOSS
  3. on a peer's death: FAILED (first detector wins); the receivers of the dead
     node's messages publish CUT; every survivor derives the same (dead, k)
  4. a data-parallel reduce done (inside the stream): REDUCED; a tied weight's
     copies summed: TIED; a holder whose stage's owner died in a late sync's
     window asks another pipeline's owner for the stage's gradients: LOAN, answered
     by LENT; the stream ran: FINISHED, with the node's report so far. A pipeline
     gathers its marks on the data plane: its collector writes every node's
     FINISHED (and LOSS) in one transaction (bamboo/runtime/marks.py); after
     anything out of the way in it, each node writes its own
  5. fp16: the loss scale it ran with, and whether it overflowed: SCALE; the
     iteration's report: DONE (in an epoch's calibration iteration with eager, the
     median op times); the first to see every live node's writes REGROUP (the failed
     set from now on, reconfigure?, checkpoint?, the cost models FRC is placed with).
     The collector writes every DONE of its pipeline with the marks when their
     reports are final; without a collector, the node whose FINISHED completed a
     pipeline that lost nobody writes them, with REGROUP (bamboo/runtime/boundary.py)
  6. an iteration no pipeline can finish: ABORT; each node undoes its steps: ABORTED
  7. fatal error: ERROR; an injected preemption: PREEMPTED
  8. at a checkpoint, each node keeping checkpoint layers in host memory: COPIES
     (its newest: the iteration and the layers), replaced at every checkpoint

The agents' half:
  1. claim an ID, register MEMBERS (under a lease) and ZONES
  2. meet in torch elastic's rendezvous (RENDEZVOUS_*); its rank 0 writes ASSIGNMENT 0
  3. when a REGROUP asks for it, or after an ABORT once every live node ABORTED:
     create ASSIGNMENT(epoch + 1), clearing the redone iterations' keys
  4. a cloud's preemption notice: NOTICES; leave on SIGTERM or a notice: DRAIN
  5. --redundancy auto: after each iteration's REGROUP, the mode wanted: MODE; a
     boundary that finds it differs from its epoch's asks to reconfigure
  6. on its way out (done, released, drained): LEFT
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NewType

from bamboo.control.assignment import Assignment
from bamboo.control.config import JobConfig
from bamboo.control.records import checked, plain

# A node's id in the job (members/, alive/, failed/, an assignment's pipelines), and
# its place in its own pipeline (0..P-1: the schedules' `peer`). Both are ints at run
# time; the types keep the two apart along the failure path (Failover.node_of).
NodeId = NewType("NodeId", int)
Local = NewType("Local", int)

ROOT = "/bamboo/"                 # every job's keys: /bamboo/<job>/...
RENDEZVOUS_ROOT = "/bamboo-rdzv/"  # torch elastic's rendezvous of a job's first agents


class Record:
    """A value in etcd: a frozen dataclass of JSON-able fields."""

    def to_dict(self) -> dict:
        return plain(self)

    @classmethod
    def from_dict(cls, d: dict):
        """The record stored as `d`, each field's type checked (BadRecord)."""
        return cls(**checked(cls, d))


PART_DIGITS = 8  # of each number in a key (iterations, nodes, epochs, tries)


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


# -- records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Start(Record):
    iteration: int                 # where the first epoch starts (0, or a checkpoint's)


@dataclass(frozen=True)
class Alive(Record):
    node: int
    lease: int = 0                 # its etcd lease: peers ask etcd how long ago it was refreshed


LEASE_EXPIRED = "lease expired"    # Failure.how of a node found silent, not seen to break
STRAGGLER = "straggler"            # Failure.how of a node whose compute fell far behind its peers'
HOST_LOST = "host lost"            # Failure.how of a node silent since a node of its host died


@dataclass(frozen=True)
class Failure(Record):
    iteration: int
    by: int                        # the node that detected it
    how: str = ""
    time: float = 0.0              # wall clock when it was recorded (0: not known)


@dataclass(frozen=True)
class Cut(Record):
    counts: dict                   # message kind -> how many arrived from the dead node


@dataclass(frozen=True)
class Mark(Record):
    """A key whose presence is the message (finished, aborted, an id claimed)."""


@dataclass(frozen=True)
class Finished(Record):
    """A node ran its whole stream, with its report as of then (a Report as a dict;
    None: it writes its report itself). The node whose mark completes its pipeline
    may copy the pipeline's to DONE (bamboo/runtime/boundary.py)."""
    report: dict | None = None


@dataclass(frozen=True)
class Loss(Record):
    value: float


@dataclass(frozen=True)
class LossScale(Record):
    """fp16's dynamic loss scale as one iteration ran with it: every copy of every
    stage agrees on it, because an overflow anywhere shows in the global norm
    (NORM) that every node reads before its steps."""
    scale: float             # the iteration's loss was multiplied by this before the backward
    good: int = 0            # steps in a row without an overflow before it
    overflow: bool = False   # its gradients overflowed: every owner and replica skipped the step

    def following(self, window: int, minimum: float) -> "LossScale":
        """The next iteration's: halved after an overflow (not below `minimum`),
        doubled after `window` good steps in a row (torch's GradScaler rule)."""
        if self.overflow:
            return LossScale(max(minimum, self.scale / 2))
        if self.good + 1 >= window:
            return LossScale(self.scale * 2)
        return LossScale(self.scale, self.good + 1)


@dataclass(frozen=True)
class ModeChoice(Record):
    """--redundancy auto or --replica-sync auto: the mode and sync the agents want
    after an iteration ("": the job's sync), and what they observed to choose them
    (agents.modes.ModeStats as a dict)."""
    mode: str
    stats: dict = field(default_factory=dict)
    sync: str = ""


@dataclass(frozen=True)
class Report(Record):
    rss_mb: float                  # peak resident memory of the worker so far
    time: float
    epoch: int
    events: list = field(default_factory=list)   # FailedOver events this node wrote, as dicts
    busy: float = 0.0              # seconds of this iteration spent computing (not waiting on peers)
    digests: dict | None = None    # stage -> digest of parameters and optimizer state
    cuda_mb: float = 0.0           # peak CUDA memory allocated by the worker so far (0: on the CPU)
    op_ms: dict | None = None      # op -> median ms, in an epoch's calibration iteration (runtime/calibration.py)
    base_rss_mb: float = 0.0       # resident memory before the worker built any layer
    sent_bytes: dict = field(default_factory=dict)  # payload bytes sent since the worker started, by kind


@dataclass(frozen=True)
class Abort(Record):
    why: str
    by: int


@dataclass(frozen=True)
class Regroup(Record):
    failed: tuple[int, ...]        # the failed nodes every worker uses from the next iteration
    reconfigure: bool              # the agents write a new epoch first
    checkpoint: bool = False       # every node snapshots this iteration
    costs: dict | None = None      # pipeline -> the cost model eager places FRC with from now on

    def __post_init__(self):
        object.__setattr__(self, "failed", _ints(self.failed))


@dataclass(frozen=True)
class Reduced(Record):
    members: tuple[int, ...]       # the nodes whose gradients the finished reduce summed

    def __post_init__(self):
        object.__setattr__(self, "members", _ints(self.members))


# What a stage's owner in another pipeline lends a holder whose owner died in a late
# sync's window (bamboo/runtime/lending.py): the gradients it stepped with in the
# iteration before, or this iteration's reduced sum.
LOANS = ("kept", "reduced")


@dataclass(frozen=True)
class Loan(Record):
    stage: int
    what: str                      # one of LOANS (a lender answers any other with sent=False)


@dataclass(frozen=True)
class Lent(Record):
    stage: int
    what: str                      # one of LOANS
    sent: bool                     # False: the lender holds none (the borrower asks another)


@dataclass(frozen=True)
class Timestamp(Record):
    time: float                    # wall clock, seconds


@dataclass(frozen=True)
class Preempted(Record):
    iteration: int
    time: float


@dataclass(frozen=True)
class WorkerError(Record):
    message: str                   # one line: "TypeName: what happened"


@dataclass(frozen=True)
class Member(Record):
    zone: str
    host: str
    lease: int = 0                 # the agent's etcd lease (see Alive)


@dataclass(frozen=True)
class Zone(Record):
    zone: str
    host: str = ""                 # the machine it shares with other nodes (bamboo-agent --host); "": its own
    since: float = 0.0             # wall clock when its agent's process started: its paid time (0: not known)


@dataclass(frozen=True)
class Outcome(Record):
    complete: bool                 # every participant got and sent all its layers
    why: str = ""                  # why not


@dataclass(frozen=True)
class Copies(Record):
    """The checkpoint layers a node keeps in host memory (bamboo/state/copies.py)."""
    iteration: int                 # the checkpoint taken before this iteration
    layers: tuple[int, ...]        # the layer indexes it holds of it
    loss_scale: dict | None = None  # fp16: the loss scale record stored with the checkpoint

    def __post_init__(self):
        object.__setattr__(self, "layers", _ints(self.layers))


@dataclass(frozen=True)
class Notice(Record):
    source: str                    # ec2 | gcp
    time: float
    action: str | None = None


@dataclass(frozen=True)
class Release(Record):
    """The surplus rule's decision for one epoch: the nodes in no pipeline it gives
    back, the standby it keeps, and the nodes the job asks for (the group's desired
    capacity; a preemption leaves it, so a lost node is replaced)."""
    nodes: tuple[int, ...]         # node ids released
    standby: int                   # nodes in no pipeline kept warm
    desired: int                   # nodes asked for
    ceiling: int                   # the most the job asks for: the group's size when it started
    since: float                   # when the first decision was written (epoch seconds): bursts are seen from then

    def __post_init__(self):
        object.__setattr__(self, "nodes", _ints(self.nodes))


# -- key families ----------------------------------------------------------------------
@dataclass(frozen=True)
class Key:
    family: "Family"
    parts: tuple[int, ...]

    @property
    def path(self) -> str:
        """The key (or prefix) below the job's root. Numbers are zero-padded, so
        that etcd's byte order is their order: keys of iterations a..b are one range."""
        return "/".join([self.family.name, *(f"{p:0{PART_DIGITS}d}" for p in self.parts)])

    @property
    def complete(self) -> bool:
        return len(self.parts) == len(self.family.params)


@dataclass(frozen=True)
class Family:
    name: str
    params: tuple[str, ...]        # the integer parts that follow the name
    record: type                   # has to_dict() and from_dict()
    doc: str

    def __call__(self, *parts: int) -> Key:
        if len(parts) > len(self.params):
            raise TypeError(f"{self.name} takes at most {len(self.params)} parts ({', '.join(self.params)})")
        return Key(self, _ints(parts))

    def parse(self, rest: str):
        """The parts of a key below this family's prefix: an int, or a tuple of them
        (ValueError for parts that are not integers: not a key of this family)."""
        parts = _ints(rest.split("/"))
        return parts[0] if len(parts) == 1 else parts


CONFIG = Family("config", (), JobConfig, "the job's settings (written once by the launcher)")
START = Family("start", (), Start, "the iteration the first epoch starts from")
ASSIGNMENT = Family("assignment", ("epoch",), Assignment,
                    "node -> (pipeline, stage) from an iteration on; created if absent: one decision stands")
ALIVE = Family("alive", ("node",), Alive, "a worker runs (under its lease: gone when it stops refreshing it)")
FAILED = Family("failed", ("node",), Failure, "a node is dead; first detector wins (create-if-absent)")
CUT = Family("cut", ("iteration", "dead", "node"), Cut, "messages node received from dead, per kind")
FINISHED = Family("finished", ("iteration", "node"), Finished,
                  "node ran its whole stream (it stays to help), with its report as of then")
LOSS = Family("loss", ("iteration", "microbatch"), Loss,
              "a global microbatch's loss, written once the last stage's stream has them all")
VAL_LOSS = Family("val_loss", ("iteration", "microbatch"), Loss,
                  "a validation microbatch's loss after the iteration's step (--eval-every)")
DONE = Family("done", ("iteration", "node"), Report, "node's iteration report (memory, events, digests)")
ABORT = Family("abort", ("iteration",), Abort, "a pipeline cannot finish the iteration: all abandon it, it is redone")
ABORTED = Family("aborted", ("iteration", "node"), Mark, "node undid its steps and waits for the agents")
REGROUP = Family("regroup", ("iteration", "try"), Regroup,
                 "the boundary's agreement; a new try when a node dies while regrouping")
HANDED = Family("handed", ("epoch", "node"), Mark, "node got and sent every layer of the epoch's handover")
HANDOVER = Family("handover", ("epoch",), Outcome,
                  "the epoch's handover completed everywhere, or failed (a participant died); one decision stands")
REDUCED = Family("reduced", ("iteration", "stage"), Reduced, "a data-parallel reduce of stage finished")
LOAN = Family("loan", ("iteration", "lender", "borrower"), Loan,
              "borrower asks lender for a stage's gradients (its owner died in a late sync's window)")
LENT = Family("lent", ("iteration", "lender", "borrower"), Lent, "lender's answer to a loan: sent, or none held")
NORM = Family("norm", ("iteration", "stage"), Loss, "stage's squared gradient norm, reduced and tied (clipping)")
SCALE = Family("scale", ("iteration",), LossScale,
               "fp16: the loss scale the iteration ran with and whether it overflowed (at its boundary)")
MODE = Family("mode", ("iteration",), ModeChoice,
              "--redundancy auto: the mode wanted after the iteration; the boundary after the next one switches")
TIED = Family("tied", ("iteration", "pipeline"), Reduced, "a pipeline's tied-weight gradients were summed")
CHECKPOINTED = Family("checkpointed", (), Timestamp, "when the last checkpoint was decided")
COMPLETED = Family("completed", ("node",), Timestamp,
                   "node left the finished job: the last iteration agreed, its checkpoint written, its layers saved")
PREEMPTED = Family("preempted", ("node",), Preempted, "an injected SIGKILL (for the metrics)")
ERROR = Family("error", ("node",), WorkerError, "a worker's fatal error")
IDS = Family("ids", ("node",), Mark, "the node id is taken (never reused)")
MEMBERS = Family("members", ("node",), Member, "an agent runs the node (under the agent's lease)")
ZONES = Family("zones", ("node",), Zone, "the node's zone, kept after it is gone")
DRAIN = Family("drain", ("node",), Timestamp, "the node asked to leave (SIGTERM, a notice)")
LEFT = Family("left", ("node",), Timestamp, "the node's agent stopped (done, released, drained): its paid time ends")
NOTICES = Family("notices", ("node",), Notice, "the cloud's preemption notice")
RELEASES = Family("releases", ("epoch",), Release,
                  "the surplus rule's decision for an epoch's nodes in no pipeline (first writer wins)")
COPIES = Family("copies", ("node",), Copies,
                "the newest checkpoint's layers the node keeps in host memory (a rollback's first source)")

FAMILIES = (CONFIG, START, ASSIGNMENT, ALIVE, FAILED, CUT, FINISHED, LOSS, VAL_LOSS, DONE, ABORT, ABORTED, REGROUP,
            HANDED, HANDOVER, REDUCED, LOAN, LENT, TIED, NORM, SCALE, MODE, CHECKPOINTED, COMPLETED, PREEMPTED, ERROR,
            IDS, MEMBERS, ZONES, DRAIN, LEFT, NOTICES, COPIES, RELEASES)

# One attempt at an iteration: cleared when the iteration (or a checkpoint's span) runs again.
ITERATION_FAMILIES = (DONE, LOSS, VAL_LOSS, FINISHED, CUT, REDUCED, LOAN, LENT, TIED, NORM, SCALE, REGROUP, ABORT,
                      ABORTED)


JOB_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # one rule for etcd prefixes, buckets and cloud labels


def check_job_name(job: str) -> None:
    """ValueError unless `job` is a job name: a job's keys, bucket prefix and cloud
    labels all carry it, and `/` in it would reach into another job's keys."""
    if not JOB_NAME.fullmatch(job):
        raise ValueError(f"--job {job!r}: a job name is 1 to 63 of a-z, 0-9 and '-', starting with a letter "
                         "or digit (it names etcd keys, bucket prefixes and cloud labels)")


def job_root(job: str) -> str:
    return f"{ROOT}{job}/"


def job_of(key: str) -> str | None:
    """The job a raw etcd key belongs to."""
    return key[len(ROOT):].split("/", 1)[0] if key.startswith(ROOT) else None


def parse(key: str) -> tuple[str, Family, object] | None:
    """(job, family, parts) of a raw etcd key under ROOT; None for other keys."""
    job = job_of(key)
    if job is None:
        return None
    rest = key[len(job_root(job)):]
    for family in FAMILIES:
        if rest == family.name:
            return job, family, ()
        if rest.startswith(family.name + "/"):
            try:
                return job, family, family.parse(rest[len(family.name) + 1:])
            except ValueError:
                return None
    return None


def scan(client) -> list[tuple[str, Family, object]]:
    """(job, family, parts) of every protocol key in an etcd (a pyetcd client)."""
    return [found for _, meta in client.get_prefix(ROOT) if (found := parse(meta.key.decode()))]


# -- torch.distributed store prefixes (process group rendezvous) ------------------------
def world_store(epoch: int, iteration: int | None = None, attempt: int = 0) -> str:
    """The world group of an epoch's live nodes, or of a regroup after a death."""
    return f"pg/world/e{epoch}" if iteration is None else f"pg/regroup/e{epoch}-it{iteration}-{attempt}"


def handover_store(epoch: int) -> str:
    return f"pg/handover/{epoch}"


def reduce_store(epoch: int, stage: int, members) -> str:
    return f"pg/reduce/e{epoch}-stage{stage}/{'-'.join(map(str, members))}"


def copies_store(epoch: int, members) -> str:
    """The group that moves checkpoint copies at an epoch's checkpoints (kept while its members are)."""
    return f"pg/copies/e{epoch}/{'-'.join(map(str, members))}"


def tie_store(epoch: int, pipeline: int, members) -> str:
    """The group that sums a tied weight's gradient over its copies in one pipeline."""
    return f"pg/tie/e{epoch}-pipeline{pipeline}/{'-'.join(map(str, members))}"


def rendezvous_prefix(job: str) -> str:
    """torch elastic's rendezvous of a job's first agents: its state and its store."""
    return f"{RENDEZVOUS_ROOT}{job}/"
