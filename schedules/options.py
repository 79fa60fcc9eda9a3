"""The choices a schedule is compiled with, as one value.

Each choice is a `Choice`: a str enum, so a value read from a flag, a job file or
etcd ("eager") and the member (Redundancy.EAGER) compare, hash, print and serialise
alike. `ScheduleOptions` holds one of each, checked once where it is made, and goes
whole to the compiler, the recovery compiler, the runtime and the simulators.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum

from schedules.layout import ScheduleError


class Choice(str, Enum):
    """One of a flag's values. It is its value wherever a str is: in comparisons,
    as a dict key, in messages and in JSON."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Redundancy(Choice):
    """--redundancy: eager runs the successor's forward (FRC) in the bubbles; lazy
    keeps the replica and computes only after a death; off keeps no replica."""
    EAGER = "eager"
    LAZY = "lazy"
    OFF = "off"


class JobRedundancy(Choice):
    """--redundancy of a job: a schedule's mode, or auto (the agents pick one from
    the measured preemption rate, epoch by epoch)."""
    EAGER = "eager"
    LAZY = "lazy"
    OFF = "off"
    AUTO = "auto"


class Order(Choice):
    """The compute order of one virtual stage."""
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class Frc(Choice):
    """--frc, with eager: FRC only in the waits it fits, or for every microbatch."""
    BUBBLES = "bubbles"
    ALL = "all"


class ReplicaSync(Choice):
    """--replica-sync: a replica's sync at the iteration's end or in the next one.
    NONE is compiled only: the first iteration of `next` owes no sync."""
    END = "end"
    NEXT = "next"
    NONE = "none"


SYNC_CHOICES = (ReplicaSync.END.value, ReplicaSync.NEXT.value)  # a user's; NONE is compiled only


class JobReplicaSync(Choice):
    """--replica-sync of a run: a schedule's sync, or auto (chosen epoch by epoch
    from the measured costs and death rate, agents/modes.py)."""
    END = "end"
    NEXT = "next"
    AUTO = "auto"


class BackwardSplit(Choice):
    """--backward-split: each node's last backwards split (input gradients first),
    as deep as the cost model says, or none."""
    LAST = "last"
    OFF = "off"


def make_members(record, kinds: dict[str, type[Choice]], refused) -> None:
    """Each field of the frozen dataclass `record` that `kinds` names made a member of
    its Choice (a value read from a flag, a job file or etcd is a str);
    `refused(name, kind, value)` is the error raised for a value no member has."""
    for f in fields(record):
        kind, value = kinds.get(f.name), getattr(record, f.name)
        if kind is None or isinstance(value, kind):
            continue
        try:
            object.__setattr__(record, f.name, kind(value))
        except ValueError:
            raise refused(f.name, kind, value) from None


def keeps_replicas(redundancy: str) -> bool:
    """Eager and lazy redundancy both hold and sync the next stage's layers; only
    eager runs its forward (FRC) before a failure."""
    return redundancy != Redundancy.OFF


FLAGS = {"redundancy": "--redundancy", "order": "--order", "frc": "--frc", "sync": "--replica-sync",
         "split": "--backward-split", "ahead": "--compute-ahead"}


@dataclass(frozen=True)
class ScheduleOptions:
    """How every stream of a job is compiled. Strings are accepted and made members;
    a value no member has is a ScheduleError naming the flag."""
    redundancy: Redundancy = Redundancy.EAGER
    order: Order = Order.ONE_F_ONE_B
    frc: Frc = Frc.BUBBLES
    sync: ReplicaSync = ReplicaSync.END
    split: BackwardSplit = BackwardSplit.LAST
    ahead: bool = False  # the next iteration's first forwards run during this one's tail (schedules/overlap.py)

    def __post_init__(self):
        def refused(name: str, kind: type[Choice], value) -> ScheduleError:
            shown = kind.values() if kind is not ReplicaSync else SYNC_CHOICES
            return ScheduleError(f"{FLAGS[name]} must be one of {', '.join(shown)} (got {value!r})")
        make_members(self, _KINDS, refused)
        if not isinstance(self.ahead, bool):
            raise ScheduleError(f"{FLAGS['ahead']} is on or off (got {self.ahead!r})")

    def with_(self, **changes) -> ScheduleOptions:
        return replace(self, **changes)

    @property
    def keeps_replicas(self) -> bool:
        return keeps_replicas(self.redundancy)

    @property
    def every_frc(self) -> bool:
        """Whether every replica holder runs FRC for every microbatch (eager, --frc all)."""
        return self.redundancy is Redundancy.EAGER and self.frc is Frc.ALL


_KINDS = {"redundancy": Redundancy, "order": Order, "frc": Frc, "sync": ReplicaSync, "split": BackwardSplit}
