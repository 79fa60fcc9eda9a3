"""The run-time surplus decision (agents/release.py) on hand-built epochs: what it
releases, keeps and asks for, against counts worked out independently (the
standby from the summed-convolution tail of tests/unit/agents/test_surplus.py)."""
import math

from agents.policy import slot_estimate
from agents.release import bursts, decide_release
from bamboo.control.assignment import Assignment
from bamboo.control.config import JobConfig
from bamboo.control.protocol import Failure, Release

from tests.unit.agents.test_surplus import by_convolution

CFG = JobConfig.of(surplus="burst", acquire_seconds=2.0, standby_epsilon=0.01)
EIGHT = {str(n): "abc"[n % 3] for n in range(8)}
EPOCH = Assignment(0, 0, ((0, 2, 1), (3, 5, 4)), standby=(6, 7))


def test_with_no_burst_seen_every_node_in_no_pipeline_goes():
    out = decide_release(CFG, EPOCH, EIGHT, None, (), 1000.0)
    assert out == Release((6, 7), 0, 6, 8, 1000.0)


def test_after_a_death_the_request_stands_and_the_idle_node_waits():
    """Two of pipeline 0 died: four nodes live, one pipeline and one node over. The
    job still asks for six (the last decision's), so nothing goes."""
    live = {n: z for n, z in EIGHT.items() if n in ("0", "3", "4", "5")}
    epoch = Assignment(1, 6, ((3, 5, 4),), standby=(0,))
    out = decide_release(CFG, epoch, live, Release((6, 7), 0, 6, 8, 1000.0), (2,), 1030.0)
    assert out.nodes == () and out.desired == 6


def test_after_bursts_the_rule_keeps_the_standby_that_earns_its_price():
    """Six nodes in two pipelines of three (a node holds one stage) after four
    bursts of two in 30 s, replacements 300 s away. The rule's ceiling is the
    smallest k whose tail of losses within 300 s is within 0.01 (by convolution,
    with auto's prior: 0.05 deaths per node-hour over 2 node-hours of six nodes,
    0.1 single bursts in 1200 s), at most 8 - 6 = 2. A first loss breaks a
    pipeline: the job trains at one pipeline's rate (the stage-slot estimate) until
    the replacement comes, which the first standby saves whenever a node goes; a
    second loss costs nothing more (four nodes still make one pipeline), so a second
    standby earns nothing and only one is kept, and asked for."""
    cfg = JobConfig.of(surplus="burst", acquire_seconds=300.0, standby_epsilon=0.01, stages=3,
                       max_stages_per_node=1)
    epoch = Assignment(2, 9, ((0, 8, 9), (3, 5, 4)))
    live = {n: EIGHT.get(n, "c") for n in ("0", "8", "9", "3", "5", "4")}
    mass = by_convolution((2, 2, 2, 2), 30.0, 300.0, 10, 0.1, 1200.0)
    k = next(k for k in range(11) if 1 - mass[:k + 1].sum() <= 0.01)
    estimate = slot_estimate(cfg.schedule.microbatches)
    two, one = 1 / estimate([("0", "8", "9"), ("3", "5", "4")]), 1 / estimate([("0", "8", "9")])
    assert min(k, 2) == 2 and (1 - mass[0]) * (two - one) >= two / 6  # the first earns its price
    out = decide_release(cfg, epoch, live, Release((), 0, 6, 8, 1000.0), (2, 2, 2, 2), 1030.0)
    assert out.standby == 1 and out.desired == 7 and out.nodes == ()


def test_before_any_preemption_the_prior_justifies_no_standby_worth_its_price():
    """Eight nodes, two pipelines of three, replacements 300 s away, no death yet:
    auto's prior (six trainers at 0.05 per node-hour) loses one node within 300 s
    with chance 1 - exp(-0.025), so the rule's ceiling is one standby; but that
    node would save under 2.5% of the throughput for an eighth of the bill, so both
    idle nodes go."""
    cfg = JobConfig.of(surplus="burst", acquire_seconds=300.0, standby_epsilon=0.01)
    assert 1 - math.exp(-0.025) < 1 / 8
    out = decide_release(cfg, EPOCH, EIGHT, None, (), 1000.0)
    assert out == Release((6, 7), 0, 6, 8, 1000.0)


def test_nodes_released_before_are_gone_even_if_still_registered():
    """Nodes 6 and 7 were released but have not left yet: a new epoch's decision
    neither counts them held nor releases them again."""
    out = decide_release(CFG, EPOCH, EIGHT, Release((6, 7), 0, 6, 8, 1000.0), (), 1010.0)
    assert out == Release((), 0, 6, 8, 1000.0)


def test_fixed_keeps_its_count():
    cfg = JobConfig.of(surplus="fixed", fixed_standby=1)
    assert decide_release(cfg, EPOCH, EIGHT, None, (), 0.0) == Release((7,), 1, 7, 8, 0.0)


def test_bursts_are_the_deaths_of_one_iteration():
    failed = {1: Failure(6, 0), 2: Failure(6, 3), 7: Failure(9, 0), 4: Failure(2, 5)}
    assert bursts(failed) == (1, 2, 1)


def test_a_node_of_a_shared_machine_is_never_released():
    """Node 6 shares a machine with others: only node 7 goes."""
    out = decide_release(CFG, EPOCH, EIGHT, None, (), 0.0, shared=frozenset({"6"}))
    assert out.nodes == (7,) and out.desired == 7


def test_a_node_that_joined_after_the_epoch_is_neither_held_nor_released_by_it():
    """After a burst the job asks for six. Epoch 3 has one pipeline and nodes 3 and
    8 in standby; newcomer 9 registered after it was made. The epoch holds five of
    the six asked for, so its standby waits for the next epoch, which places 3, 8
    and 9 as a pipeline; counting 9 would have released 3 and 8."""
    epoch = Assignment(3, 9, ((0, 2, 1),), standby=(3, 8))
    live = {n: EIGHT.get(n, "a") for n in ("0", "1", "2", "3", "8", "9")}
    out = decide_release(CFG, epoch, live, Release((6, 7), 0, 6, 8, 1000.0), (2,), 1030.0)
    assert out.nodes == () and out.desired == 6
