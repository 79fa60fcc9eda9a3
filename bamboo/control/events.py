"""The events of an iteration's metrics record (the `events` list of each line the
launcher writes): typed records beside the protocol's, each serialised the one way
Event.to_dict says, so the metrics file's JSON has one source. A worker's failover
event rides to the launcher in its Report, as that same dict."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from bamboo.control.protocol import Record


@dataclass(frozen=True)
class Event(Record):
    """What happened in an iteration, as the metrics file lists it: {"type": TYPE,
    then the fields in order}; a field named after a Python keyword ends in `_`."""
    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"type": self.TYPE, **{k.rstrip("_"): v for k, v in asdict(self).items()}}

    @staticmethod
    def from_json(d: dict) -> "Event":
        """An event as a report carried it through etcd (to_dict's output)."""
        cls = next((c for c in Event.__subclasses__() if c.TYPE == d.get("type")), None)
        if cls is None:
            raise ValueError(f"a report carried an event of unknown type {d.get('type')!r}")
        return cls(**{f.name: d[f.name.rstrip("_")] for f in fields(cls)})

    @classmethod
    def from_dict(cls, d: dict):
        return Event.from_json(d)


@dataclass(frozen=True)
class FailedOver(Event):
    """A pipeline absorbed a death: `by` took the stage over (written by `by`)."""
    TYPE = "failover"
    node: int
    iteration: int
    died_before: int               # the dead node ran its stream up to this instruction
    by: int
    agree_seconds: float           # from the death seen to the recovery plan agreed
    lent_by: int | None = None     # a death in a late sync's window: the other pipeline's owner that lent ...
    lent: str = ""                 # ... its kept or reduced gradients of the stage (bamboo/runtime/lending.py)
    lend_seconds: float = 0.0      # from the ask to the gradients here


@dataclass(frozen=True)
class Redone(Event):
    TYPE = "redo"
    abandoned: int                 # the iteration no pipeline could finish
    from_: int                     # where the agents restarted the job
    restore: int | None            # the checkpoint they loaded, if any
    why: str = ""                  # the abort's reason, as the node that gave the iteration up wrote it (Assignment)


@dataclass(frozen=True)
class Preemption(Event):
    TYPE = "preemption"
    node: int
    pause_seconds: float           # from the kill to the iteration recorded


@dataclass(frozen=True)
class NoticeSeen(Event):
    TYPE = "notice"
    node: int
    source: str
    action: str | None


@dataclass(frozen=True)
class Reconfigured(Event):
    TYPE = "reconfigure"
    epoch: int
    pipelines: list                # a node on two stages of a short pipeline is named at both
    standby: list
    redundancy: str
    microbatches: list = ()        # each pipeline's share of the global M (by speed: a short one runs fewer)
    sync: str = "end"              # its replica sync: at the iteration's end, or in the next one


@dataclass(frozen=True)
class ModeSwitched(Event):
    TYPE = "mode"
    epoch: int
    from_: str                     # a setting (agents/modes.py): the mode, "eager+next" with the sync in the next
    to: str                        # iteration


@dataclass(frozen=True)
class Overflow(Event):
    TYPE = "overflow"
    iteration: int
    loss_scale: float              # every copy skipped its step; the next runs at half


@dataclass(frozen=True)
class EvalSkipped(Event):
    TYPE = "eval_skipped"
    iteration: int
    arrived: int                   # validation losses that came before a death cut it short
    of: int
