"""`bamboo-agent --workers N`: one machine of N workers (a multi-GPU spot instance).

The machine's process starts N agents (agents/agent.py), one per worker: each is
a node of its own, with its id, its lease and its device (LOCAL_RANK: cuda:i,
or the CPU), and each registers the machine's name (`--host`) so that the policy
keeps the machine's nodes off neighbouring stages. Its loss is one event: the
agents die with this process (PR_SET_PDEATHSIG), their workers with them, and
the surviving agents record them dead together (Membership._host_losses).
SIGTERM drains every one of its nodes.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from bamboo.control.etcd import die_with_parent
from bamboo.control.exits import FENCED
from bamboo.transport.devices import LOCAL_RANK

AGENT = "agents.agent"
OWN = ("--workers", "--node", "--host")  # flags this process sets for each of its agents


def agent_argv(argv: list[str], host: str, node: int | None) -> list[str]:
    """The command line of one of the machine's agents: this one's, less the
    flags the machine sets, with its host (and its id when ids are given)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in OWN:
            skip = True
        elif not token.startswith(tuple(f"{flag}=" for flag in OWN)):
            out.append(token)
    return out + ["--host", host] + (["--node", str(node)] if node is not None else [])


class Host:
    """The machine's agents: started together, signalled together, waited for."""

    def __init__(self, argv: list[str], host: str, workers: int, node: int | None):
        self.argv, self.host, self.workers, self.node = argv, host, workers, node
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        base = int(os.environ.get(LOCAL_RANK, "0") or 0)  # a local launch's machines share the GPUs
        for i in range(self.workers):
            node = None if self.node is None else self.node + i
            env = {**os.environ, LOCAL_RANK: str(base + i)}
            self.procs.append(subprocess.Popen([sys.executable, "-m", AGENT, *agent_argv(self.argv, self.host, node)],
                                               env=env, preexec_fn=die_with_parent))

    def signal(self, signum: int) -> None:
        """SIGTERM (a drain) for every node of the machine."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def wait(self) -> int:
        """0 when every agent finished; FENCED when some node was lost (killed or
        fenced) and none failed otherwise; else 1."""
        codes = [p.wait() for p in self.procs]
        if all(c == 0 for c in codes):
            return 0
        return FENCED if all(c in (0, FENCED, -signal.SIGKILL) for c in codes) else 1


def supervise(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> int:
    """Run the machine's agents until each has ended; `args`: bamboo-agent's."""
    if args.workers < 1:
        parser.error(f"--workers must be at least 1 (got {args.workers})")
    machine = Host(argv, args.host or socket.gethostname(), args.workers, args.node)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, frame: machine.signal(s))
    machine.start()
    return machine.wait()
