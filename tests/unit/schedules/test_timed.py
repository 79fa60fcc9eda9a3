"""A trial timed from its first change (fast.py `Timed`) against the same trial
timed whole: the compiler's searches must pick what they picked when every trial
ran the whole iteration, so the two numbers must be equal, not close."""
import random

import pytest

from schedules import ir
from schedules.compiler import compile_schedule
from schedules.cost import CostModel
from schedules.early_grads import split_last, splittable
from schedules.ir import Op
from schedules.options import ScheduleOptions
from schedules.timing.bubbles import makespan
from schedules.timing.fast import Timed, finish_time, start_times


def model(stages: int, seed: int) -> CostModel:
    """Stages of unequal speed, slow messages and a reduce: waits everywhere."""
    rng = random.Random(seed)
    return CostModel(forward=tuple(rng.uniform(0.5, 2.0) for _ in range(stages)),
                     backward=tuple(rng.uniform(1.0, 4.0) for _ in range(stages)),
                     transfer=rng.uniform(0.0, 0.8), sync_transfer=rng.uniform(0.2, 3.0), step=rng.uniform(0.1, 1.0),
                     reduce=rng.uniform(0.0, 2.0), swap=rng.uniform(0.0, 0.3))


def whole(streams, cost) -> float:
    """The trial timed from the start, by the two whole-iteration passes."""
    end = finish_time(streams, cost)
    assert end == makespan(streams, start_times(streams, cost), cost)
    return end


CASES = [(4, 5, (), "off", "end", 0), (5, 7, (2,), "lazy", "next", 1), (6, 4, (), "eager", "next", 2),
         (6, 9, (1, 3), "eager", "end", 3), (3, 2, (), "lazy", "end", 4)]


@pytest.mark.parametrize("stages, microbatches, merged, redundancy, sync, seed", CASES)
def test_a_step_put_anywhere_is_timed_as_a_whole_run_times_it(stages, microbatches, merged, redundancy, sync, seed):
    """A replica's step (no message) put at every place of every node: the delay it
    brings reaches the peers through the messages the node sends after it."""
    cost = model(stages, seed)
    streams = compile_schedule(stages, microbatches, merged, ScheduleOptions(redundancy=redundancy, sync=sync),
                               cost).streams
    base = Timed(streams, cost)
    assert base.makespan == whole(streams, cost)
    moved = 0
    for node, stream in streams.items():
        for at in range(len(stream) + 1):
            trial = {**streams, node: stream[:at] + [ir.optimizer_step(0, True)] + stream[at:]}
            end = base.finish(trial, {node: at})
            assert end == whole(trial, cost), (node, at)
            moved += end > base.makespan
    assert moved  # some places delay the iteration: the trials are not all the base again


@pytest.mark.parametrize("stages, microbatches, merged, redundancy, sync, seed", CASES)
def test_every_depth_of_split_backwards_is_timed_as_a_whole_run_times_it(stages, microbatches, merged, redundancy,
                                                                         sync, seed):
    """Splits change several nodes at once, each from its own first split."""
    cost = model(stages, seed)
    options = ScheduleOptions(redundancy=redundancy, sync=sync, split="off")
    streams = compile_schedule(stages, microbatches, merged, options, cost).streams
    base = Timed(streams, cost)
    sends = {n: splittable(s) for n, s in streams.items()}
    assert any(sends.values())
    for depth in range(1, microbatches + 2):
        trial = {n: split_last(s, depth, sends=sends[n]) for n, s in streams.items()}
        assert trial == {n: split_last(s, depth) for n, s in streams.items()}  # the sends given change nothing
        changed = {n: at[-depth:][0] - 1 for n, at in sends.items() if at}
        assert base.finish(trial, changed) == whole(trial, cost), depth


@pytest.mark.parametrize("seed", range(4))
def test_a_late_sync_received_anywhere_is_timed_as_a_whole_run_times_it(seed):
    """The replica's late sync, taken out of its holder's stream and put back at every
    place: a receive that may wait on a message sent before the cut."""
    stages = 4 + seed
    cost = model(stages, seed)
    streams = compile_schedule(stages, 3 + seed, (), ScheduleOptions(redundancy="lazy", sync="next"), cost).streams
    tried = 0
    for node, stream in streams.items():
        taken = [i for i, ins in enumerate(stream) if ins.op is Op.RECV_SYNC]
        if not taken:
            continue
        ops = stream[taken[0]:taken[0] + 2]
        bare = {**streams, node: stream[:taken[0]] + stream[taken[0] + 2:]}
        base = Timed(bare, cost)
        for at in range(len(bare[node]) + 1):
            trial = {**bare, node: bare[node][:at] + ops + bare[node][at:]}
            assert base.finish(trial, {node: at}) == whole(trial, cost), (node, at)
            tried += 1
    assert tried > 20
