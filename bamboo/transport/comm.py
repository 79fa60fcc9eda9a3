"""Point-to-point messages between nodes over a gloo process group.

Each message is a small header (shape, dtype, a note) and the tensor, sent with the
tag of its kind (activation, gradient, replica sync): one FIFO channel per (sender,
receiver, kind), as the compiler assumes. Receiving is done ahead by one mailbox
thread per incoming channel, so a node always knows exactly how many messages a
peer delivered: after a peer dies that count is what tells survivors how far it
got. A peer's death shows up as an error on its channel (gloo closes the pair).
A gloo payload goes out only once the receiver has posted its receive, so the
mailbox posts the payload's receive with the header's, into a buffer as large as
the channel's largest payload so far (gloo takes a shorter message into a longer
buffer); a payload larger than that is preceded by an empty message that fills
the buffer posted for it. Both ends know that size: they see the same messages.
On the CPU the sender hands gloo the message at once, from its own thread; the
outbox thread only learns the outcome (docs/HOTPATH.md, "Messages").
Evaluation streams send their activations on channels of their own (another
tag, other mailboxes), so an evaluation cut short by a death never leaves a
message where training would take it, nor changes training's counts.
A GPU tensor travels through a pinned host buffer (bamboo/transport/staging.py): copied
out on a side stream once its kernels are done, sent by the outbox thread after
the copy's event, received into a pooled buffer and copied in on a side stream
that the receiver's kernels wait for. On the CPU, gloo reads the tensor itself.
With `--transport nccl` a payload goes GPU to GPU on its channel's own group
(bamboo/transport/channels.py); the header stays on gloo.
"""
from __future__ import annotations

import math
import queue
import threading
from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from schedules.ir import Op

from bamboo.control.protocol import NodeId
from bamboo.transport.staging import Copy, Stager

if TYPE_CHECKING:
    from bamboo.transport.channels import Channels

TAGS = {Op.SEND_ACT: 1, Op.SEND_GRAD: 2, Op.SEND_SYNC: 3}
# Kinds whose message may come in parts (a replica's sync in buckets, bamboo/runtime/sync.py):
# a part's note is how many elements are still to come, and the message counts once its last part landed.
PARTED = frozenset({Op.SEND_SYNC})
EVAL_TAGS = {Op.SEND_ACT: 4}  # evaluation's activations (Comm.evaluation)
NOTE_TAGS = {Op.SEND_ACT: 5}  # a few bytes of the control plane's: finished marks (Comm.notes, runtime/marks.py)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8]
_HEADER = 11  # ndim, up to 8 dims, a note (float64 bits; NaN: none), dtype code
_NOTE = 9
_EMPTY = torch.empty(0, dtype=torch.uint8)  # fills a payload receive posted too small


class PeerFailure(RuntimeError):
    """A channel to `node` broke: the node is taken for dead (Failover.detected)."""

    def __init__(self, node: NodeId, detail: str):
        super().__init__(f"node {node}: {detail}")
        self.node = node


class Interrupted(Exception):
    """A blocking receive gave up because the caller's plan changed."""


def _header(t: torch.Tensor, note: float | None = None) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0] = t.dim()
    h[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    h[_NOTE] = torch.tensor([float("nan") if note is None else note], dtype=torch.float64).view(torch.int64)[0]
    h[-1] = _DTYPES.index(t.dtype)
    return h


def _note(h: torch.Tensor) -> float | None:
    value = h[_NOTE:_NOTE + 1].view(torch.float64).item()
    return None if value != value else value


class _Mailbox:
    def __init__(self, comm: "Comm", peer: int, kind: Op):
        self.comm, self.peer, self.kind = comm, peer, kind
        self.expected = 0
        self.received = 0
        self.error: str | None = None
        self.inbox: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name=f"mailbox-{peer}-{kind.value}").start()

    def expect(self, total: int) -> None:
        with self.cond:
            self.expected = max(self.expected, total)
            self.cond.notify()

    def _run(self) -> None:
        src, tag, pg = self.comm.rank_of[self.peer], self.comm.tags[self.kind], self.comm.pg
        self.comm.own_stream()
        room = 0  # bytes of the payload receive posted with each header's (the sender counts alike)
        while True:
            with self.cond:
                while self.received >= self.expected:
                    self.cond.wait()
            try:
                h = torch.zeros(_HEADER, dtype=torch.int64)
                header = pg.recv([h], src, tag)
                if self.comm.channels is None:  # posted now, so the payload need not wait for it
                    ahead = self._buffer(room)
                    posted = pg.recv([ahead], src, tag)
                header.wait()
                shape, dtype = tuple(int(x) for x in h[1:1 + int(h[0])]), _DTYPES[int(h[-1])]
                if self.comm.channels is not None:  # straight into device memory (bamboo/transport/channels.py)
                    t = self._from_channel(shape, dtype)
                else:
                    posted.wait()
                    size = math.prod(shape) * dtype.itemsize
                    if size > room:  # `ahead` got an empty message; the payload follows
                        if self.comm.stager.on_gpu and room:
                            self.comm.stager.pool.give(ahead)
                        ahead, room = self._buffer(size), size
                        pg.recv([ahead], src, tag).wait()
                    t = ahead[:size].view(dtype).view(shape)
            except (RuntimeError, TimeoutError) as e:  # TimeoutError: a channel's rendezvous gave up
                with self.cond:
                    self.error = str(e).splitlines()[0][:200]
                self.inbox.put(None)
                return
            note = _note(h)
            with self.cond:
                self.received += self.kind not in PARTED or note is None
            self.inbox.put((t, note, ahead if self.comm.channels is None else None))

    def _buffer(self, size: int) -> torch.Tensor:
        """Room for a payload of up to `size` bytes: pooled pinned memory on CUDA."""
        stager = self.comm.stager
        if stager.on_gpu and size:
            return stager.pool.take((size,), torch.uint8)
        return torch.empty(size, dtype=torch.uint8)

    def _from_channel(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        channels = self.comm.channels
        t = torch.empty(shape, dtype=dtype, device=self.comm.device)
        work = channels.group(self.peer, self.comm.me, self.kind).recv([t], 0, 0)
        channels.wait(work, self.peer)
        return t


class _Outbox:
    """Sends to one peer on one channel, in order. A gloo send completes only once
    the peer takes it, and a paused peer never does, so a thread of its own waits
    for each (and on CUDA first for the copy to the host), and the sender learns
    the outcome from it without waiting (bamboo/runtime/failover.py)."""

    def __init__(self, comm: "Comm", peer: int, kind: Op):
        self.comm, self.peer, self.kind = comm, peer, kind
        self.dst, self.tag = comm.rank_of[peer], comm.tags[kind]
        self.room = 0  # bytes the peer's mailbox posts for each payload (see the module's docstring)
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"outbox-{peer}-{kind.value}").start()

    def put(self, staged: Copy, note: "float | Copy | None") -> "queue.Queue":
        """Queue one message; the returned queue gets None once it left, or the error.
        A host tensor with its note is handed to gloo here, in the caller's thread; a
        copy or a note still on its way to the host is waited for in the outbox's."""
        done: queue.Queue = queue.Queue(maxsize=1)
        sent = None  # (works, header): what gloo was handed here, if anything
        if self.comm.sends_at_once:  # (a note on the host: read without a wait)
            note = float(note.wait_host()) if isinstance(note, Copy) else note
            try:
                sent = self._send(staged.tensor, note)
            except RuntimeError as e:
                done.put(str(e).splitlines()[0][:200])
                return done
        self.queue.put((sent, note, staged, done))
        return done

    def _send(self, tensor: torch.Tensor, note: float | None) -> tuple[list, torch.Tensor]:
        """Hand one message to gloo (see the module's docstring): its works, and the
        header, held until they completed."""
        pg, header = self.comm.pg, _header(tensor, note)
        works = [pg.send([header], self.dst, self.tag)]
        if (size := tensor.numel() * tensor.element_size()) > self.room:
            works.append(pg.send([_EMPTY], self.dst, self.tag))
            self.room = size
        return works + [pg.send([tensor], self.dst, self.tag)], header

    def _run(self) -> None:
        self.comm.own_stream()
        while True:
            sent, note, staged, done = self.queue.get()
            try:
                works, _ = sent or self._send_later(staged, note)  # (the header lives until here)
                for work in works:
                    work.wait()
            except (RuntimeError, TimeoutError) as e:  # a buffer gloo may still be reading is not reused
                done.put(str(e).splitlines()[0][:200])
                continue
            if staged.event is not None and self.comm.channels is None and not staged.kept:  # a pooled buffer
                self.comm.stager.pool.give(staged.tensor)
            done.put(None)

    def _send_later(self, staged: Copy, note: "float | Copy | None") -> tuple[list, torch.Tensor | None]:
        """Send from this thread: after the copy to the host (gloo), or on the channel."""
        channels = self.comm.channels
        # gloo: this thread waits for the copy out, not the compute; a channel's
        # stream waits for the kernels that wrote the tensor, the host does not
        tensor = staged.wait_here() if channels is not None else staged.wait_host()
        if isinstance(note, Copy):
            value = float(note.wait_host())
            if note.event is not None:
                self.comm.stager.pool.give(note.tensor)
            note = value
        if channels is None:
            return self._send(tensor, note)
        # the header on gloo, the payload on the channel's group
        self.comm.pg.send([_header(tensor, note)], self.dst, self.tag).wait()
        work = channels.group(self.comm.me, self.peer, self.kind).send([tensor], 1, 0)
        channels.wait(work, self.peer)
        return [], None


class Comm:
    def __init__(self, pg: dist.ProcessGroup, rank_of: dict[int, int], device: torch.device, tags: dict = TAGS,
                 stager: Stager | None = None, channels: Channels | None = None, sent: Counter | None = None):
        self.pg, self.rank_of, self.device, self.tags = pg, rank_of, device, tags
        self.sent = Counter() if sent is None else sent  # payload bytes sent, by kind (the worker's, across worlds)
        self.me = next(n for n, r in rank_of.items() if r == pg.rank())
        self.stager = stager or Stager(device)  # host buffers for GPU tensors
        self.channels = channels  # --transport nccl: payloads on a group per channel, no staging
        # Host tensors go to gloo from the sender's thread (GPU ones after their copy, in the outbox's).
        self.sends_at_once = channels is None and not self.stager.on_gpu
        self._boxes: dict[tuple[int, Op], _Mailbox] = {}
        self._outboxes: dict[tuple[int, Op], _Outbox] = {}
        self._posted: list[tuple[int, queue.Queue]] = []  # (peer, outcome) of sends posted, oldest first
        self._failed: list[PeerFailure] = []              # posted sends found failed, not yet raised
        # The same group's evaluation channels (no threads until first used).
        self.evaluation = Comm(pg, rank_of, device, EVAL_TAGS, self.stager) if tags is TAGS else None
        self.notes = Comm(pg, rank_of, device, NOTE_TAGS, self.stager) if tags is TAGS else None

    def _box(self, peer: int, kind: Op) -> _Mailbox:
        if (peer, kind) not in self._boxes:
            self._boxes[(peer, kind)] = _Mailbox(self, peer, kind)
        return self._boxes[(peer, kind)]

    def expect(self, peer: int, kind: Op, total: int) -> None:
        """Receive `total` messages of `kind` from `peer` since this Comm began."""
        self._box(peer, kind).expect(total)

    def counts(self) -> dict[tuple[int, Op], int]:
        """Messages received so far on every channel, by (peer, kind)."""
        return {key: box.received for key, box in self._boxes.items()}

    def settled(self, peer: int) -> bool:
        """Nothing more can come from `peer`: on every channel from it, the channel
        broke or every message expected has arrived. (One channel breaking is not
        enough: a message may still be landing on another.)"""
        return all(b.error or b.received >= b.expected for (p, _), b in self._boxes.items() if p == peer)

    def _outbox(self, peer: int, kind: Op) -> _Outbox:
        if (peer, kind) not in self._outboxes:
            self._outboxes[(peer, kind)] = _Outbox(self, peer, kind)
        return self._outboxes[(peer, kind)]

    def send(self, peer: int, kind: Op, tensor: torch.Tensor, peer_dead=lambda: False,
             note: float | None = None) -> None:
        """Send, waiting until gloo has it or `peer_dead()` says the peer is recorded
        dead (a paused peer may never take it): then the message is lost with the
        peer, as for any dead node, and PeerFailure says so. `note`, a number that
        travels in the header (a microbatch's loss with its gradient), arrives with it."""
        self.sent[kind.value] += tensor.numel() * tensor.element_size()
        done = self._outbox(peer, kind).put(self._staged(tensor), note)
        while True:
            try:
                error = done.get(timeout=0.05)  # asks as often as a receive does
                break
            except queue.Empty:
                if peer_dead():
                    raise PeerFailure(peer, "recorded dead while a send to it was pending") from None
        if error is not None:
            raise PeerFailure(peer, error)

    def _staged(self, tensor: torch.Tensor) -> Copy:
        """What the outbox sends: gloo a host copy; a channel the tensor where it is,
        with an event after the kernels that wrote it, which the outbox's own stream
        waits for (NCCL would otherwise wait for all the compute queued until it sends)."""
        if self.channels is None:
            return self.stager.to_host(tensor, copy=False)
        t = tensor.detach().contiguous()
        if t.device.type != "cuda":
            return Copy(t)
        event = self.stager.cuda.Event()
        event.record(self.stager.cuda.current_stream(t.device))
        return Copy(t, event, self.stager.cuda)

    def own_stream(self) -> None:
        """A mailbox's or outbox's thread works on its GPU, and with channels on a
        stream of its own, so that NCCL's operations order after what they need only."""
        self.stager.own_thread()
        if self.channels is not None and self.device.type == "cuda":
            self.stager.cuda.set_stream(self.stager.cuda.Stream(self.device))

    def post(self, peer: int, kind: Op, tensor: torch.Tensor, note: "float | torch.Tensor | None" = None,
             keep: bool = False, later: bool = False) -> Copy | None:
        """Queue a send and go on computing while it leaves (docs/HOTPATH.md, finding 5).
        Its outcome is learnt by a later `post` or by `flush`: after this one is queued,
        an earlier send found failed raises PeerFailure. The tensor must not change
        in place afterwards (activations and gradients never do). `keep`: return the
        host copy gloo sends from, when there is one (a GPU tensor), for the caller
        to keep instead of making its own (it gives the buffer back to the pool).
        `later`: an earlier failure is raised by the next post or flush, not here (a
        post from a backward's hook, which must not be cut short)."""
        if isinstance(note, torch.Tensor):  # read by the outbox: no host synchronisation here
            note = self.stager.to_host(note.reshape(1), copy=False)
        self.sent[kind.value] += tensor.numel() * tensor.element_size()
        staged = self._staged(tensor)
        kept = keep and staged.event is not None and self.channels is None  # a pooled host copy
        staged.kept = kept
        self._posted.append((peer, self._outbox(peer, kind).put(staged, note)))
        still = []
        for peer_of, done in self._posted:
            try:
                error = done.get_nowait()
            except queue.Empty:
                still.append((peer_of, done))
                continue
            if error is not None:
                self._failed.append(PeerFailure(peer_of, error))
        self._posted = still
        if self._failed and not later:
            staged.kept = False  # nobody keeps it now: the outbox gives it back (unless it is past that)
            raise self._failed.pop(0)
        return staged if kept else None

    def pending(self) -> bool:
        """Whether a posted send's outcome is still to be learnt."""
        return bool(self._posted or self._failed)

    def flush(self, peer_dead) -> None:
        """Wait until every posted send left, oldest first. A send whose peer
        `peer_dead(peer)` says is gone, or which failed, raises PeerFailure (once per
        failure; call again for the rest): the peer's pending sends are lost with it."""
        if self._failed:
            raise self._failed.pop(0)
        while self._posted:
            peer, done = self._posted[0]
            try:
                error = done.get(timeout=0.05)  # asks as often as a receive does
            except queue.Empty:
                if peer_dead(peer):
                    self._posted = [(p, d) for p, d in self._posted if p != peer]
                    raise PeerFailure(peer, "recorded dead while a send to it was pending") from None
                continue
            self._posted.pop(0)
            if error is not None:
                raise PeerFailure(peer, error)

    def recv(self, peer: int, kind: Op, keep_waiting=lambda: True, poll: float = 0.05) -> torch.Tensor:
        return self.recv_noted(peer, kind, keep_waiting, poll)[0]

    def recv_noted(self, peer: int, kind: Op, keep_waiting=lambda: True, poll: float = 0.05) \
            -> tuple[torch.Tensor, float | None]:
        """The next message of `kind` from `peer`, and the note it came with (None: none)."""
        box = self._box(peer, kind)
        while True:
            try:
                message = box.inbox.get(timeout=poll)
            except queue.Empty:
                if not keep_waiting():
                    raise Interrupted() from None
                continue
            if message is None:
                box.inbox.put(None)  # stays closed for later receives
                raise PeerFailure(peer, box.error or "channel closed")
            t, note, buffer = message
            if self.channels is not None and t.device.type == "cuda":
                t.record_stream(self.stager.cuda.current_stream(self.device))  # made on the mailbox's stream
                return t, note
            return (self.stager.to_device(t, buffer).wait_here() if self.stager.on_gpu else t), note

    @property
    def carries_notes(self) -> bool:
        """Whether the control plane's notes go on this Comm (a world's, not its evaluation's)."""
        return self.notes is not None

    def note(self, peer: int, data: bytes) -> None:
        """Send a few bytes on the notes' channel (`notes`), not waiting for them to
        leave: like any message, they are lost with a peer that dies."""
        self.notes.post(peer, Op.SEND_ACT, torch.frombuffer(bytearray(data), dtype=torch.uint8), later=True)

    def take_note(self, peer: int) -> bytes | None:
        """The next note from `peer` if one came (None: none yet, or its channel
        broke: the failover finds the death), a receive for the one after posted."""
        box = self.notes._box(peer, Op.SEND_ACT)
        box.expect(box.received + 1)
        try:
            message = box.inbox.get_nowait()
        except queue.Empty:
            return None
        if message is None:
            box.inbox.put(None)  # stays closed
            return None
        t, _, buffer = message
        data = t.numpy().tobytes()
        if self.stager.on_gpu and buffer is not None and buffer.numel():
            self.stager.pool.give(buffer)
        return data

    def close(self) -> None:
        """This world is done (abandoned, or replaced): give up every channel."""
        if self.channels is not None:
            self.channels.close()

    def abort_peer(self, peer: int) -> None:
        """`peer` died: give up its channels (NCCL's never break by themselves), so
        that waits on them end and `settled` holds. Gloo's world channels break alone."""
        if self.channels is not None:
            self.channels.abort(peer)
