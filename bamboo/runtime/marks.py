"""A pipeline's finished marks gathered on the data plane: one etcd transaction per
pipeline per iteration, not one per node.

When its stream ends, each node but the pipeline's collector (its first live node)
sends its mark (its report so far, and the losses it holds) to the collector as a
note on the data plane. The collector, once its own stream ended and every mark
came, writes them all in one transaction, with every node's report when the
marks' reports are final (bamboo/runtime/worker.py `_promotes`), and then tells each
node so. The marks in etcd mean what they meant when each node wrote its own: a
node that dies once the pipeline's marks are all written died between iterations.

Anything out of the way (a death in the pipeline, a silent peer, an abort) ends
the gathering for the iteration: the collector writes what it gathered at once,
and every node writes its own mark from then on (Failover.finished), as it did
before any was gathered. A note is untrusted bytes: bounded, its fields checked.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from bamboo.control.protocol import DONE, FINISHED, LOSS, Finished, Loss, NodeId, Record, Report

NOTE_LIMIT = 1 << 16  # bytes of one note (a report is a few hundred, an epoch's op times a few thousand)
NOTE_WAIT = 0.005     # a gathering node looks at its notes and its watch this often at first ...
NOTE_WAIT_MOST = 0.02  # ... and less often the longer it waits, down to this


class BadNote(ValueError):
    """A note that is no mark of this pipeline's iteration (dropped: its sender's mark
    then never comes, and the pipeline waits on it as on a node that has not finished)."""


@dataclass(frozen=True)
class MarkNote(Record):
    """A node's finished mark, sent to its pipeline's collector; or the collector's
    answer (`written`): the marks are in etcd, with every report if `reported`."""
    iteration: int
    node: int
    report: dict | None = None
    losses: dict = field(default_factory=dict)  # global microbatch (a string, as JSON keys are) -> loss
    written: bool = False
    reported: bool = False


def encode(note: MarkNote) -> bytes:
    data = json.dumps(note.to_dict(), separators=(",", ":")).encode()
    if len(data) > NOTE_LIMIT:
        raise ValueError(f"a finished mark of {len(data)} bytes exceeds the note limit of {NOTE_LIMIT}")
    return data


def decode(data: bytes, iteration: int, sender: NodeId) -> MarkNote:
    """The note `sender` sent in `iteration` (BadNote: anything else)."""
    if len(data) > NOTE_LIMIT:
        raise BadNote(f"a note of {len(data)} bytes from node {sender}")
    try:
        note = MarkNote.from_dict(json.loads(data))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in note.losses.values())
        if not numbers or any(int(g) < 0 for g in note.losses):
            raise ValueError("its losses are no {microbatch: number}")
    except (ValueError, TypeError) as e:
        raise BadNote(f"a note from node {sender} is no mark: {e}") from None
    if (note.iteration, note.node) != (iteration, sender):
        raise BadNote(f"a note from node {sender} says iteration {note.iteration}, node {note.node}")
    if note.report is not None:
        try:
            Report.from_dict(note.report)
        except (ValueError, TypeError) as e:
            raise BadNote(f"a note from node {sender} carries no report: {e}") from None
    return note


class Gather:
    """One iteration's gathering of a pipeline's marks, as one node takes part in it.
    `plane`: the data plane's notes (Comm.note, Comm.take_note)."""

    def __init__(self, iteration: int, live: tuple[NodeId, ...], me: NodeId, plane, final: bool):
        self.iteration, self.live, self.me, self.plane, self.final = iteration, live, me, plane, final
        self.collector = live[0]
        self.notes: dict[NodeId, MarkNote] = {}  # the collector's: marks come so far, its own once its stream ended
        self.on = True         # still gathering (False: every node writes its own mark)
        self.sent = False      # this node's mark went to the collector ...
        self.carried: dict = {}  # ... with these losses ({LOSS key: Loss}), written only once it says so
        self.written = False   # the collector wrote every mark (and told the others)
        self.reported = False  # every report of the pipeline was written with the marks
        self.pause = NOTE_WAIT  # the next wait's

    @property
    def collecting(self) -> bool:
        return self.me == self.collector

    def finish(self, report: dict | None, losses: dict) -> None:
        """This node's stream ended: its mark goes to the collector (the collector keeps its own)."""
        note = MarkNote(self.iteration, self.me, report, {str(k.parts[-1]): v.value for k, v in losses.items()})
        if self.collecting:
            self.notes[self.me] = note
            return
        self.plane.note(self.collector, encode(note))
        self.sent, self.carried = True, dict(losses)

    def _next_note(self, sender: NodeId) -> MarkNote | None:
        """The next note of this iteration from `sender` that came, if any (the rest dropped, each with a line)."""
        while (data := self.plane.take_note(sender)) is not None:
            try:
                return decode(data, self.iteration, sender)
            except BadNote as e:
                print(f"bamboo.runtime.marks: node {self.me}: dropped {e}", flush=True)
        return None

    def take(self) -> None:
        """The collector: every mark that came since the last take."""
        for node in self.live:
            if node not in self.notes and (note := self._next_note(node)) is not None:
                self.notes[node] = note
                self.pause = NOTE_WAIT  # the next mark may follow soon

    def complete(self) -> bool:
        return all(node in self.notes for node in self.live)

    def records(self, reports: bool = True) -> dict:
        """The collector's transaction: every gathered mark, its losses, and, once every
        mark came and their reports are final, every report (unless not `reports`)."""
        out: dict = {}
        reports = reports and self.complete() and self.final and all(n.report is not None for n in self.notes.values())
        for node, note in self.notes.items():
            out[FINISHED(self.iteration, node)] = Finished(note.report)
            out.update({LOSS(self.iteration, int(g)): Loss(v) for g, v in note.losses.items()})
            if reports:
                out[DONE(self.iteration, node)] = Report.from_dict(note.report)
        self.reported = reports
        return out

    def tell(self) -> None:
        """The collector, once every mark is written: each node may go on."""
        self.written = True
        for node in self.live[1:]:
            self.plane.note(node, encode(MarkNote(self.iteration, self.me, written=True, reported=self.reported)))

    def answered(self) -> bool:
        """A node that sent its mark: whether the collector said every mark is written."""
        while not self.written and (note := self._next_note(self.collector)) is not None:
            if note.written:
                self.written, self.reported = True, note.reported
        return self.written

    def wait(self) -> None:
        """A pause between looks, twice as long each time up to NOTE_WAIT_MOST: a node
        that waits long (its pipeline's first stage ends its stream last) wakes less,
        and a pipeline's nodes waiting in a loaded process do not crowd out the rest."""
        time.sleep(self.pause)
        self.pause = min(2 * self.pause, NOTE_WAIT_MOST)
