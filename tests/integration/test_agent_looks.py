"""When an agent looks at etcd (Membership.due): once for a regroup, every round in a
death's aftermath, and at least once a second; never at every round of a job that
nothing disturbs. Real etcd and real watches; the clock is the test's."""
import time
import types

import pytest

import agents.membership as membership
from agents.membership import LOOK_EVERY, Membership
from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import CONFIG, FAILED, LEASE_EXPIRED, MEMBERS, REGROUP, Failure, Member, Regroup
from commands.scale.census import WATCH_EVENTS, etcd_counters

TIMEOUT = 0.5


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(membership, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    return now


def test_an_agent_looks_when_something_it_reads_changed(etcd, clock):
    cfg = JobConfig.of(job="looks", failure_timeout=TIMEOUT)
    writer = Cluster(etcd.endpoint, "looks")
    writer.put(CONFIG(), cfg)
    agent = Membership(Cluster(etcd.endpoint, "looks"), "a", 0, cfg)
    try:
        writer.wait_for(lambda: writer.get(MEMBERS(0)), timeout=10, what="the agent's members key")
        # the only member leads: from then on it watches what it decides from (its own join came before)
        assert agent.routine is None and agent.leads()
        agent.routine.take()  # the flag its arming raised: the one awaited next is the join's
        writer.put(MEMBERS(99), Member("a", "h", 0))
        assert agent.routine.flag.wait(10)
        assert agent.due()          # its join: one look ...
        assert not agent.due()      # ... not more
        clock[0] += LOOK_EVERY / 2
        assert not agent.due()

        writer.put(REGROUP(0, 0), Regroup((), False, False))
        assert agent.routine.flag.wait(10)  # the watch saw it
        assert agent.due()          # a regroup: one look ...
        assert not agent.due()      # ... not more

        writer.create(FAILED(7), Failure(0, 1, "test"))
        assert agent.events.flag.wait(10)
        assert agent.due() and agent.due()  # a death: every round looks ...
        clock[0] += TIMEOUT + LOOK_EVERY / 2
        assert agent.due()
        clock[0] += LOOK_EVERY / 2 + 0.1
        assert not agent.due()      # ... for the failure timeout and a second

        clock[0] += LOOK_EVERY
        assert agent.due()          # and at least once a second
        assert not agent.due()
    finally:
        agent.leave()


def _two_agents(etcd, job: str) -> tuple[Cluster, Membership, Membership]:
    """A job's writer and two agents, nodes 3 and 8, once both are members."""
    cfg = JobConfig.of(job=job, failure_timeout=TIMEOUT)
    writer = Cluster(etcd.endpoint, job)
    writer.put(CONFIG(), cfg)
    first = Membership(Cluster(etcd.endpoint, job), "a", 3, cfg)
    second = Membership(Cluster(etcd.endpoint, job), "b", 8, cfg)
    writer.wait_for(lambda: writer.get(MEMBERS(3)) and writer.get(MEMBERS(8)), timeout=10, what="both members")
    return writer, first, second


def test_only_the_leading_agent_looks_and_the_next_leads_once_it_left(etcd, clock):
    writer, first, second = _two_agents(etcd, "leads")
    try:
        assert first.due() and first.leading
        writer.put(REGROUP(0, 0), Regroup((), False, False))
        writer.create(FAILED(7), Failure(0, 1, "test"))
        assert second.events.flag.wait(10) and second.routine is None  # a regroup is no news to it: not sent
        clock[0] += LOOK_EVERY
        assert not second.due() and not second.leading  # neither a regroup, a death nor a second makes it look
        first.leave()  # its lease revoked: its members key goes
        writer.wait_for(lambda: writer.get(MEMBERS(3)) is None, timeout=10, what="the leader's key to go")
        assert second.members.flag.wait(10)
        assert second.due() and second.leading  # the next leads, and looks at once
        assert second.routine is not None
    finally:
        first.leave()
        second.leave()


def test_etcd_sends_an_agent_only_the_joins_that_may_change_who_leads(etcd, clock):
    """A job's start grew as N x N when every agent heard every join: a join of a
    higher id now reaches only the leader (who decides), one of a lower id also each
    agent above it. Counted by etcd itself (the events it sent its watchers)."""
    writer, first, second = _two_agents(etcd, "joins")
    try:
        assert first.due() and first.leading and not second.leads()
        first.routine.take(), first.members.take(), second.members.take()
        sent = etcd_counters(etcd.endpoint)[WATCH_EVENTS]
        writer.put(MEMBERS(99), Member("c", "h", 0))  # above both: only the leader's decisions read it
        writer.put(MEMBERS(1), Member("c", "h", 0))   # below both: each may no longer lead
        assert first.members.flag.wait(10) and second.members.flag.wait(10)  # after the 99's, on their streams
        assert first.routine.flag.wait(10)
        assert etcd_counters(etcd.endpoint)[WATCH_EVENTS] - sent == 4  # 99: the leader; 1: the leader, both
    finally:
        first.leave()
        second.leave()


def test_the_next_in_line_records_a_silent_leader_dead_and_leads(etcd):
    """A leader in standby that vanished has no worker peers to find it silent: the
    agent next in line judges its lease (real clock: etcd ages leases in seconds)."""
    writer, first, second = _two_agents(etcd, "silent-leader")
    try:
        assert not second.leads()
        first.heartbeat.halt()  # its machine is gone: the lease is left to age
        writer.wait_for(lambda: second.leads(), timeout=30, what="the next in line to lead", poll=0.1)
        failure = writer.get(FAILED(3))
        assert failure.by == 8 and failure.how == LEASE_EXPIRED
        assert writer.get(MEMBERS(3)) is None  # its lease revoked with the record
    finally:
        first.leave()
        second.leave()
