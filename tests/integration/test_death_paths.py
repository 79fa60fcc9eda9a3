"""The rule for simultaneous deaths (schedules/deaths.py, docs/faults.md) against the
three places that act on it, for every death set of two small layouts with short
pipelines (nine nodes at P=4, seven at P=3), without processes:

- the compiler: a pipeline the rule says absorbs its death gets a recovery plan that
  the schedule simulator validates, at the start, middle and end of the dead node's
  stream, for the pipeline's own share of the microbatches; one it says cannot is
  refused (or, with two dead nodes, is one the failover abandons);
- the agents: the stages they find lost everywhere (`Assignment.lost`) are the rule's,
  in every mode; they roll back from memory (`copies.newest_covered` over the copies
  the runtime places, `copies.holders`) exactly where the rule says; and the
  microbatch split of the configuration before and after the deaths covers every
  global microbatch once;
- the cluster simulator: the deaths, removed from a trace at once, are counted under
  the rule's path."""
from dataclasses import replace
from itertools import combinations

import pytest

from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.deaths import IN_ITERATION, MEMORY, PATHS, PEERS, STORAGE, absorbs, lost_everywhere, path
from schedules.layout import ScheduleError
from schedules.split import merged

from bamboo.control.protocol import Copies
from bamboo.state.copies import holders, newest_covered

from agents.membership import from_policy
from agents.membership import lost_everywhere as agents_lost
from agents.policy import Config, next_config, slot_estimate
from sim.profiles import profile
from sim.reconfiguration import memory_copies
from sim.simulator import ClusterSimulator, Options
from sim.traces import Event
from schedules.options import ScheduleOptions

LAYOUTS = [(9, 4, 8), (7, 3, 6)]  # nodes, P, global M
# where the simulator's cost model lays out a short pipeline (1,024 death sets at 10 nodes: slow)
SIM_LAYOUTS = [pytest.param(10, 4, 24, marks=pytest.mark.slow), (8, 3, 24)]
ZONES = "abc"
CHECKPOINT = 6  # the iteration of the checkpoint whose copies the nodes keep


def layout(nodes: int, depth: int, microbatches: int) -> tuple[Config, dict[str, str]]:
    zones = {str(n): ZONES[n % 3] for n in range(nodes)}
    config = next_config(zones, None, depth, microbatches, 2, slot_estimate(microbatches))
    assert len(config.pipelines) >= 2 and any(merged(p) for p in config.pipelines)  # short pipelines exist
    return config, zones


def death_sets(config: Config):
    used = sorted({n for p in config.pipelines for n in p})
    for k in range(1, len(used) + 1):
        yield from (set(c) for c in combinations(used, k))


@pytest.mark.parametrize("nodes,depth,microbatches", LAYOUTS)
def test_the_compiler_plans_a_recovery_exactly_where_the_rule_says_a_pipeline_absorbs(nodes, depth, microbatches):
    config, _ = layout(nodes, depth, microbatches)
    shares = from_policy(config, 0, ()).microbatches
    for mode in ("eager", "lazy"):
        for j, pipe in enumerate(config.pipelines):
            m = len(shares(microbatches, j))
            folded = tuple(sorted(merged(pipe)))
            base = compile_schedule(depth, m, folded, options=ScheduleOptions(redundancy=mode)).streams
            for node in sorted(set(pipe)):
                first = pipe.index(node)
                ok = absorbs(pipe, {node}, replicas=True)
                for k in sorted({0, len(base[first]) // 2, len(base[first])}):
                    try:
                        simulate(compile_recovery(depth, m, first, k, folded, options=ScheduleOptions(redundancy=mode)))
                        planned = True
                    except ScheduleError:
                        planned = False
                    assert planned == ok, (mode, pipe, node, k)
            for a, b in combinations(sorted(set(pipe)), 2):
                assert not absorbs(pipe, {a, b}, replicas=True)  # the failover abandons two at once


@pytest.mark.parametrize("nodes,depth,microbatches", LAYOUTS)
def test_the_agents_find_lost_what_the_rule_finds_lost_and_the_split_covers_every_microbatch(
        nodes, depth, microbatches):
    config, zones = layout(nodes, depth, microbatches)
    assignment = from_policy(config, 0, ())
    kept = holders(assignment, (), {int(n): z for n, z in zones.items()})  # the runtime's copies, a layer a stage
    copies = {stage: {owner, holder} - {None} for stage, owner, holder in kept}
    records = {n: Copies(CHECKPOINT, tuple(s for s, held in copies.items() if n in held))
               for n in {n for held in copies.values() for n in held}}
    covered = sorted(i for j in range(len(config.pipelines)) for i in assignment.microbatches(microbatches, j))
    assert covered == list(range(microbatches))
    for dead in death_sets(config):
        for mode, replicas in (("eager", True), ("lazy", True), ("off", False)):
            assert agents_lost(assignment, {int(n) for n in dead}, mode) == lost_everywhere(
                config.pipelines, dead, replicas), (mode, dead)
        live = {n: z for n, z in zones.items() if n not in dead}
        rollback = path(assignment.pipelines, {int(n) for n in dead}, True, copies)
        if rollback in (MEMORY, STORAGE):  # the agents roll back from memory when the live copies cover every layer
            covered = newest_covered(records, {int(n) for n in live}, depth, at_most=CHECKPOINT)
            assert (covered == CHECKPOINT) == (rollback == MEMORY), (sorted(dead), rollback)
        if path(config.pipelines, dead, True) != IN_ITERATION and live:
            after = next_config(live, config, depth, microbatches, 2, slot_estimate(microbatches))
            if after.depth == depth and after.pipelines:
                redo = from_policy(after, 0, ())
                covered = sorted(i for j in range(len(after.pipelines)) for i in redo.microbatches(microbatches, j))
                assert covered == list(range(microbatches)), dead


@pytest.mark.parametrize("nodes,depth,microbatches", SIM_LAYOUTS)
def test_the_simulator_counts_each_death_set_under_the_rule_s_path(nodes, depth, microbatches):
    """Every death set at 1800 s, after a checkpoint at 600 s (the copies in memory
    then sit where the runtime would put them)."""
    gpt2 = replace(profile("gpt2", "calibrated"), microbatches=microbatches)
    zones = {str(n): ZONES[n % 3] for n in range(nodes)}
    start = [Event(0.0, "add", n, z) for n, z in zones.items()]
    options = Options(checkpoint_seconds=600.0, surplus="keep")  # every node kept: short pipelines by speed alone
    config = ClusterSimulator(gpt2, depth, "bamboo", options).next_config(zones, None)  # by its cost model
    assert any(merged(p) for p in config.pipelines)
    copies = memory_copies(config, zones)
    seen = dict.fromkeys(PATHS, 0)
    for dead in death_sets(config):
        events = start + [Event(1800.0, "remove", n, zones[n]) for n in sorted(dead)] + \
            [Event(3600.0, "add", "late", "a")]
        survived = ClusterSimulator(gpt2, depth, "bamboo", options).run(events)["deaths_survived"]
        want = path(config.pipelines, dead, True, copies)
        assert survived == {p: len(dead) if p == want else 0 for p in PATHS}, (sorted(dead), want)
        seen[want] += 1
    # every path but memory is taken here (no death set of these layouts loses a stage
    # everywhere and leaves every stage's copy; tests/unit/sim/test_sim_bursts.py has one that does)
    assert seen[IN_ITERATION] and seen[PEERS] and seen[STORAGE], seen
