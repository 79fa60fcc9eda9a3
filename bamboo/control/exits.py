"""How a worker's life ends other than by finishing: exceptions that travel up to
`bamboo.runtime.worker.main`, which maps each to the exit status its agent (or the
launcher) reads. Below main, only an injected preemption (a SIGKILL of itself)
ends the process, and the heartbeat (bamboo/control/liveness.py), which exits FENCED
when the lease expired while the node was recorded dead."""
from __future__ import annotations

import os
import signal
import time

from bamboo.control.protocol import PREEMPTED, Preempted

FENCED = 75  # exit status of a worker that found itself declared dead and stopped
PARKED = 76  # exit status of a worker whose node has no stage in the new configuration
RELEASED = 77  # exit status of an agent whose node the surplus rule released: its machine leaves, the group shrinks


class WorkerExit(Exception):
    """The worker stops here; `status` is its process's exit status."""
    status = 0


class Fenced(WorkerExit):
    """Its peers count this node dead (it was paused past its lease, or cut off):
    it stops as a dead node would, whatever it was doing."""
    status = FENCED


class Parked(WorkerExit):
    """The node has no stage in the new configuration, or was drained while in
    standby: back to its agent, which may start it again."""
    status = PARKED


class Released(WorkerExit):
    """The job finished while the node waited in standby."""
    status = 0


def preempt_if_due(cfg, cluster, node: int, iteration: int, instruction: int, phase: str) -> None:
    """An injected preemption (--preempt): SIGKILL this process, and under agents
    its agent too (the node goes), just before `instruction` of `phase`'s stream."""
    for p in cfg.testing.preempt:
        if p.fires(node, iteration, instruction, phase):
            cluster.put(PREEMPTED(node), Preempted(iteration, time.time()))
            if cfg.cluster.elastic:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
