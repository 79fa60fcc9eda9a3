"""The first configuration: how long the first agents wait for each other, and with
whom they start: nodes that die in the first seconds must not hang a job.

torch elastic's dynamic rendezvous gathers them. It closes at once when every node
asked for met (`--max-nodes`), or a last-call window (`--last-call`) after enough
met for one pipeline (`--min-nodes`, by default the policy's own rule:
`nodes_for_a_pipeline`), and gives up after `--start-timeout`. Every agent of the
round then tries to write assignment 0 (create-if-absent: one stands), over the
nodes alive at that moment rather than over the round: torch keeps a dead
participant in a round for three keep-alives (15 s), and a node may die after the
round closed; one that dies after assignment 0 is written is an ordinary failure of
epoch 0 (the workers' `starting` lease check). Then it closes the rendezvous, so
an agent that came too late for the round, waiting for a next one, goes to standby.
"""
from __future__ import annotations

import argparse
import math

from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousGracefulExitError,
                                                      RendezvousTimeoutError)

from agents.policy import nodes_for_a_pipeline
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.liveness import lease_ages
from bamboo.control.protocol import DRAIN, MEMBERS


class StartFailed(RuntimeError):
    """No first configuration can be made: fewer than one pipeline of nodes came (one line)."""


def seconds(text: str) -> float:
    """A duration flag: a finite number of seconds, not negative."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, not negative (got {text})")
    return value


def add_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of the first configuration's wait."""
    ap.add_argument("--min-nodes", type=int, help="nodes the first configuration needs (default: enough for one "
                                                  "pipeline, P / --max-stages-per-node)")
    ap.add_argument("--max-nodes", type=int, default=1024,
                    help="the nodes asked for: once this many met, the first configuration starts at once")
    ap.add_argument("--last-call", type=seconds, metavar="SECONDS",
                    help="once --min-nodes met, wait this long for the others (default: the job's, 10 s)")
    ap.add_argument("--start-timeout", type=seconds, metavar="SECONDS",
                    help="give up when fewer than --min-nodes met by then (default: the job's --stall-timeout)")


def rendezvous_options(args, cfg: JobConfig) -> dict:
    """min_nodes, max_nodes and the timeouts of the first agents' rendezvous."""
    least = args.min_nodes or nodes_for_a_pipeline(cfg.schedule.stages, cfg.schedule.max_stages_per_node)
    last_call = cfg.cluster.last_call if args.last_call is None else args.last_call
    timeout = cfg.faults.stall_timeout if args.start_timeout is None else args.start_timeout
    return dict(min_nodes=least, max_nodes=max(args.max_nodes, least), last_call_timeout=last_call,
                join_timeout=timeout)


def live_nodes(cluster: Cluster, failure_timeout: float) -> list[int]:
    """The registered agents that are not leaving and whose lease was refreshed within
    the failure timeout: a node killed a moment ago still has its key (for the lease's TTL)."""
    members = cluster.children(MEMBERS())
    draining = set(cluster.children(DRAIN()))
    ages = lease_ages(cluster, {n: m.lease for n, m in members.items() if m.lease})
    return sorted(n for n in members if n not in draining and ages.get(n, 0.0) <= failure_timeout)


def meet(handler, membership, cfg: JobConfig) -> tuple[int, int]:
    """(rank, world size) in the first agents' round, after assignment 0 is written;
    (-1, 0) when the job started without this node: it waits in standby."""
    cluster = membership.cluster
    if cluster.assignments():
        return -1, 0  # the job runs already
    least, timeout = handler.settings.min_nodes, handler.settings.timeout.join.total_seconds()
    try:
        info = handler.next_rendezvous()
    except (RendezvousClosedError, RendezvousGracefulExitError):
        return -1, 0  # the first configuration was made without this node
    except RendezvousTimeoutError:
        raise StartFailed(f"no first configuration within --start-timeout {timeout:g} s: "
                          f"{_registered(cluster, cfg)}; a pipeline needs {least}") from None
    if not cluster.assignments():
        nodes = live_nodes(cluster, cfg.faults.failure_timeout)
        if len(nodes) < least and not cluster.assignments():
            raise StartFailed(f"{_registered(cluster, cfg)} when the first agents met; a pipeline needs {least}")
        membership.first_assignment(nodes)  # create-if-absent: another agent's may stand
    handler.set_closed()  # an agent waiting for a next round goes to standby
    return info.rank, info.world_size


def _registered(cluster: Cluster, cfg: JobConfig) -> str:
    nodes = live_nodes(cluster, cfg.faults.failure_timeout)
    return f"only {len(nodes)} nodes are registered and alive ({', '.join(map(str, nodes)) or 'none'})"
