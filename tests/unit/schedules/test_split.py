"""The global microbatches over pipelines of unequal length, against brute force."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.split import estimated_slots, merged, split_by_speed

from agents.policy import lay_out
from schedules.options import ScheduleOptions


def brute_force(total, pipelines, duration):
    """The least slowest-pipeline time over every split that gives each pipeline one."""
    best = None
    for counts in itertools.product(range(1, total + 1), repeat=len(pipelines)):
        if sum(counts) == total:
            worst = max(duration(p, m) for p, m in zip(pipelines, counts))
            best = worst if best is None else min(best, worst)
    return best


shapes = st.lists(st.integers(2, 6), min_size=1, max_size=3).flatmap(
    lambda depths: st.tuples(st.just(max(depths)), st.lists(st.integers(-(-max(depths) // 2), max(depths)),
                                                            min_size=len(depths), max_size=len(depths))))


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(1, 10))
def test_split_is_as_fast_as_the_best_split(shape, extra):
    depth, lengths = shape
    pipelines = [lay_out(tuple(f"p{j}n{i}" for i in range(n)), depth) for j, n in enumerate(lengths)]
    total = len(pipelines) + extra
    split = split_by_speed(total, pipelines)
    ids = [i for r in split for i in r]
    assert ids == list(range(total))  # every microbatch once, in order: the samples do not depend on the split
    worst = max(estimated_slots(p, len(r)) for p, r in zip(pipelines, split))
    assert worst == brute_force(total, pipelines, estimated_slots)


def test_equal_pipelines_split_evenly_the_first_ones_one_more():
    full = [tuple(range(4))] * 3
    assert [len(r) for r in split_by_speed(8, full)] == [3, 3, 2]


def test_a_short_pipeline_runs_as_a_merged_one():
    short = lay_out(("a", "b", "c"), 5)
    assert short == ("a", "a", "b", "b", "c") and merged(short) == frozenset({1, 3})
    assert [len(r) for r in split_by_speed(12, [tuple(range(5)), short])] == [8, 4]


def test_every_short_pipeline_compiles_to_valid_merged_streams():
    """The compiler's streams of every short layout (P up to 7, a node on at most two
    stages), in every mode and for every microbatch count a split may give it, pass
    the validating simulator; and so does the recovery from any death its replicas
    cover (a one-stage node whose stages keep a copy)."""
    from schedules.compiler import compile_recovery, compile_schedule, simulate
    from schedules.layout import Layout, ScheduleError
    for depth in range(2, 8):
        for nodes in range(-(-depth // 2), depth):
            short = lay_out(tuple(range(nodes)), depth)
            failed = tuple(sorted(merged(short)))
            for mode in ("eager", "lazy", "off"):
                for m in (1, 2, 5):
                    base = compile_schedule(depth, m, failed, options=ScheduleOptions(redundancy=mode))
                    simulate(base)  # raises ValidationError on a bad stream
                    for dead in (s for s in range(depth) if s not in failed and mode != "off"):
                        try:
                            Layout(depth, frozenset(failed) | {dead})
                        except ScheduleError:
                            continue  # no copy left in the pipeline: a redo, not a recovery
                        simulate(compile_recovery(depth, m, dead, len(base.streams[dead]) // 2, failed, options=ScheduleOptions(redundancy=mode)))
