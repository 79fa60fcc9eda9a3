"""Where the emulated nodes run: all in this process (`InProcess`), or shared out
over child processes (`Processes`), each an interpreter of its own holding some of
the nodes. One process's threads contend for one interpreter lock, and past a
hundred nodes that lock, not etcd, sets the emulator's pace (a real fleet's nodes
run on CPUs of their own); with several processes a machine's cores all work.

The harness sees one interface either way: build the nodes, write the first
epoch, start a batch, read each node's progress, kill some, and read the etcd
latencies and CPU seconds the nodes spent. A child is told what to do over a pipe
in JSON, and the notes a pipeline's nodes send their collector
(emulator.Notes) cross processes over pipes of their own as framed bytes: nothing
from a node crosses in a pickle (each child is given its pipes and a few plain
values as it starts).
"""
from __future__ import annotations

import json
import multiprocessing
import struct
import threading
from dataclasses import dataclass

from bamboo.control.cluster import Cluster
from bamboo.control.etcd import connect
from bamboo.control.protocol import CONFIG
from commands.scale.census import cpu_seconds
from commands.scale.emulator import EmulatedNode, Killed, Notes

ZONES = ("a", "b", "c")
NODES_PER_CLIENT = 10  # emulated nodes (worker and agent) on one etcd client
_FRAME = struct.Struct("<ii")  # a note's sender and receiver, before its bytes
BUILD_SECONDS = 1800.0  # the most a child may take to register its nodes (a thousand take minutes)


@dataclass(frozen=True)
class Progress:
    """What the harness reads of a node."""
    iteration: int          # the last iteration it agreed
    started: bool           # its first iteration began (or it waits in standby)
    error: str | None       # what stopped it, when it was not killed


def build(endpoint: str, job: str, ids: list[int], seconds: float, latencies: list, notes: Notes) -> list:
    """Emulated nodes `ids` of `job` (its config read from etcd), ten to an etcd client."""
    cfg = Cluster(endpoint, job).get(CONFIG())
    clients = {}
    nodes = []
    for n in ids:
        client = clients.get(n // NODES_PER_CLIENT)
        if client is None:
            client = clients[n // NODES_PER_CLIENT] = connect(endpoint)
        nodes.append(EmulatedNode(endpoint, cfg, n, ZONES[n % len(ZONES)], seconds, latencies, notes, client))
    return nodes


def owner(node: int, count: int) -> int:
    """The child process, of `count`, that holds `node`."""
    return node % count


def progress_of(node: EmulatedNode) -> Progress:
    error = f"{type(node.error).__name__}: {node.error}" if node.error is not None else None
    return Progress(node.iteration, node.started.is_set(), error)


class InProcess:
    """Nodes on threads of this process: all of them, or a child's share."""

    def __init__(self, endpoint: str, job: str, ids: list[int], seconds: float, notes: Notes | None = None):
        self.latencies: list[float] = []
        self._mark = 0
        self.nodes = {node.node: node for node in build(endpoint, job, ids, seconds, self.latencies,
                                                           notes or Notes())}

    def first_assignment(self, members: list[int]) -> None:
        self.nodes[0].membership.first_assignment(members)

    def start(self, ids: list[int]) -> None:
        for n in ids:
            self.nodes[n].start()

    def progress(self) -> dict[int, Progress]:
        return {n: progress_of(node) for n, node in self.nodes.items()}

    def kill(self, ids: list[int]) -> None:
        for n in ids:
            self.nodes[n].kill()

    def mark(self) -> None:
        """Latencies from now on are the ones `latencies_since_mark` gives."""
        self._mark = len(self.latencies)

    def latencies_since_mark(self) -> list[float]:
        return self.latencies[self._mark:]

    def cpu_seconds(self) -> float:
        return cpu_seconds()

    def close(self) -> None:
        self.kill(list(self.nodes))  # (their clients stay open, their watch threads with them, as the process ends)


class RoutedNotes(Notes):
    """Notes to nodes of another process go down that process's pipe."""

    def __init__(self, owner, me: int, outbound: dict):
        super().__init__()
        self.owner, self.me, self.outbound = owner, me, outbound
        self.locks = {p: threading.Lock() for p in outbound}

    def deliver(self, sender: int, receiver: int, data: bytes) -> None:
        place = self.owner(receiver)
        if place == self.me:
            super().deliver(sender, receiver, data)
            return
        with self.locks[place]:
            self.outbound[place].send_bytes(_FRAME.pack(sender, receiver) + data)

    def listen(self, inbound) -> None:
        """Put every note that comes down `inbound` in this process's queues."""
        def read():
            try:
                while True:
                    frame = inbound.recv_bytes()
                    sender, receiver = _FRAME.unpack_from(frame)
                    super(RoutedNotes, self).deliver(sender, receiver, frame[_FRAME.size:])
            except (EOFError, OSError):
                return  # the other process ended
        threading.Thread(target=read, daemon=True, name="notes-in").start()


class Processes:
    """The nodes shared out over `count` child processes: node n in child n mod count."""

    def __init__(self, endpoint: str, job: str, nodes: int, seconds: float, count: int):
        ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's gRPC threads' state
        self.processes = count
        pipes = {(i, j): ctx.Pipe(duplex=False) for i in range(count) for j in range(count) if i != j}
        self.controls, self.children = [], []
        for i in range(count):
            mine, theirs = ctx.Pipe()
            inbound = [pipes[(j, i)][0] for j in range(count) if j != i]
            outbound = {j: pipes[(i, j)][1] for j in range(count) if j != i}
            child = ctx.Process(target=_serve, args=(theirs, inbound, outbound, (endpoint, job, seconds),
                                                     (i, count, nodes)), daemon=True, name=f"emulator-{i}")
            child.start()
            self.controls.append(mine)
            self.children.append(child)
        for ends in pipes.values():  # the children hold them now
            for end in ends:
                end.close()
        self._all("built", timeout=BUILD_SECONDS)

    def _ask(self, i: int, op: str, timeout: float = 120.0, **args):
        control = self.controls[i]
        control.send_bytes(json.dumps({"op": op, **args}).encode())
        if not control.poll(timeout):
            raise TimeoutError(f"emulator process {i} did not answer {op!r} within {timeout:.0f} s")
        reply = json.loads(control.recv_bytes())
        if "error" in reply:
            raise RuntimeError(f"emulator process {i}: {reply['error']}")
        return reply.get("value")

    def _all(self, op: str, timeout: float = 120.0, **args) -> list:
        return [self._ask(i, op, timeout, **args) for i in range(self.processes)]

    def _by_owner(self, ids: list[int]) -> dict[int, list[int]]:
        owned: dict[int, list[int]] = {}
        for n in ids:
            owned.setdefault(owner(n, self.processes), []).append(n)
        return owned

    def first_assignment(self, members: list[int]) -> None:
        self._ask(0, "first", members=members)

    def start(self, ids: list[int]) -> None:
        for i, owned in self._by_owner(ids).items():
            self._ask(i, "start", ids=owned)

    def progress(self) -> dict[int, Progress]:
        return {int(n): Progress(*p) for part in self._all("progress") for n, p in part.items()}

    def kill(self, ids: list[int]) -> None:
        for i, owned in self._by_owner(ids).items():
            self._ask(i, "kill", ids=owned)

    def mark(self) -> None:
        self._all("mark")

    def latencies_since_mark(self) -> list[float]:
        return [s for part in self._all("latencies") for s in part]

    def cpu_seconds(self) -> float:
        return sum(self._all("cpu"))

    def close(self) -> None:
        for i, child in enumerate(self.children):
            try:
                self._ask(i, "stop", timeout=30.0)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            child.join(timeout=10)
            if child.is_alive():
                child.kill()


def _serve(control, inbound: list, outbound: dict, run: tuple[str, str, float], share: tuple[int, int, int]) -> None:
    """A child process: build its nodes of the `run` (etcd endpoint, job, seconds an
    iteration) by its `share` (this child's index, the children, the nodes: those
    `owner` gives this child), then do what the harness asks until it says stop."""
    endpoint, job, seconds = run
    me, count, nodes = share
    threading.excepthook = quiet_killed
    notes = RoutedNotes(lambda n: owner(n, count), me, outbound)
    for pipe in inbound:
        notes.listen(pipe)
    try:
        fleet = InProcess(endpoint, job, [n for n in range(nodes) if owner(n, count) == me], seconds, notes)
    except Exception as e:  # noqa: BLE001 - said to the harness, which stops the run
        control.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    while True:
        request = json.loads(control.recv_bytes())
        try:
            value = _answer(fleet, request)
        except Exception as e:  # noqa: BLE001 - the harness says it and stops
            control.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            continue
        control.send_bytes(json.dumps({"value": value}).encode())
        if request["op"] == "stop":
            return


def _answer(fleet: InProcess, request: dict):
    op = request["op"]
    if op == "progress":
        return {n: list(vars(p).values()) for n, p in fleet.progress().items()}
    if op == "latencies":
        return fleet.latencies_since_mark()
    if op == "cpu":
        return fleet.cpu_seconds()
    if op == "first":
        fleet.first_assignment(request["members"])
    elif op in ("start", "kill"):
        getattr(fleet, op)(request["ids"])
    elif op == "mark":
        fleet.mark()
    elif op == "stop":
        fleet.close()
    elif op != "built":
        raise ValueError(f"unknown request {op!r}")
    return None


def quiet_killed(args) -> None:
    """A killed node's lease thread stops on its next etcd call (emulator.Killed):
    that is its death, not an error to print."""
    if not issubclass(args.exc_type, Killed):
        threading.__excepthook__(args)
