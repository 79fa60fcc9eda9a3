"""Compute ahead (bamboo/runtime/ahead.py): the next iteration's first forwards run on
a thread while the boundary agrees, their sends posted after it. Checked against the
same instructions run by the executor on the main thread, on the real `tiny` model
with its dropout."""
import threading

import pytest
import torch

from schedules.compiler import compile_schedule
from schedules import ir
from schedules.ir import Instr, Op

from bamboo.control.config import JobConfig
from bamboo.data.corpus import corpus_of
from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage
from bamboo.model.partition import partition
from bamboo.runtime.ahead import Ahead
from bamboo.runtime.executor import OPS, Executor
from bamboo.runtime.iteration import IterationState
from schedules.options import ScheduleOptions
from schedules.overlap import prefix_ahead
from bamboo.state.holdings import Stages
from bamboo.transport.staging import Stager

CFG = JobConfig.of(name="tiny", dtype="float64", microbatches=4, iterations=3, seed=3)
MBS = range(4, 8)  # pipeline 1's share of 8 global microbatches


@pytest.fixture(scope="module")
def executor():
    source = ModelSource.of(CFG.model)
    first = partition(source.costs(), 2)[0]
    stage = Stage([source.layer(i) for i in first], None, first.start)
    return Executor(CFG, (2, 3), 0, Stages({0: stage}, {}), corpus_of(CFG, source.seq), None, None,
                    Stager(torch.device("cpu")))


def on_main_thread(executor, iteration: int, stream: list[Instr]) -> IterationState:
    executor.it = IterationState(iteration, MBS, None, None, stream=stream)
    for pc, ins in enumerate(prefix_ahead(stream)):
        executor.it.pc = pc
        if ins.op is not Op.SEND_ACT:  # no peer here: what a send would post is in `acts`
            OPS[ins.op](executor, ins)
    return executor.it


def _leading(stream: list[Instr], first: int = 0) -> list[Instr]:
    """The stream's loads, forwards and activation sends from `first` on, up to the
    first other op or FRC's forward."""
    end = next(k for k in range(first, len(stream))
               if stream[k].op not in (Op.LOAD, Op.FORWARD, Op.SEND_ACT) or stream[k].redundant)
    return stream[first:end]


@pytest.mark.parametrize("mode", ["off", "lazy", "eager"])
def test_only_a_stream_that_begins_at_stage_0_has_work_to_run_ahead(mode):
    streams = compile_schedule(4, 8, (), options=ScheduleOptions(redundancy=mode)).streams
    prefix = prefix_ahead(streams[0])
    assert prefix == _leading(streams[0]) and [i.mb for i in prefix if i.op is Op.FORWARD] == [0, 1, 2, 3]
    assert all(prefix_ahead(streams[n]) == [] for n in (1, 2, 3))
    merged = compile_schedule(4, 8, (1,), options=ScheduleOptions(redundancy=mode)).streams[0]  # node 0 runs stages 0 and 1
    assert prefix_ahead(merged)[:4] == [ir.load(0), Instr(Op.FORWARD, 0, 0), Instr(Op.FORWARD, 1, 0),
                                        Instr(Op.SEND_ACT, 1, 0, 2)]


def test_the_forwards_run_ahead_equal_the_main_threads_bit_for_bit(executor):
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off")).streams[0]
    want = on_main_thread(executor, 2, stream)
    ahead = Ahead(executor, OPS, 2, stream, prefix_ahead(stream), MBS)
    got = IterationState(2, MBS, None, None)
    assert ahead.take(got, stream) == len(_leading(stream)) == 6  # two forwards, each loaded and sent
    sent = [k for k, i in enumerate(ahead.prefix) if i.op is Op.SEND_ACT]
    assert torch.equal(ahead.activation(sent[1]), want.acts[(0, 1)])  # waits for the forward before it
    ahead.finish(got)
    assert all(torch.equal(got.acts[(0, mb)], want.acts[(0, mb)]) for mb in (0, 1))
    assert torch.equal(got.inputs[0], want.inputs[0]) and sorted(got.drawn) == sorted(want.drawn) == [2, 3]
    assert got.states[(0, 0)][1].grad_fn is not None and got.busy > 0  # its backward can run on the main thread
    other = on_main_thread(executor, 3, stream)  # another iteration draws other samples and dropout
    assert not torch.equal(other.acts[(0, 0)], want.acts[(0, 0)])


def test_with_compute_ahead_stage_0_begins_with_more_forwards(executor):
    """The order compute ahead is compiled with (schedules/overlap.py) runs ahead all
    its leading forwards, taken as the main thread would have run them."""
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off", ahead=True)).streams[0]
    prefix = prefix_ahead(stream)
    assert len([i for i in prefix if i.op is Op.FORWARD]) > 2
    want = on_main_thread(executor, 2, stream)
    ahead = Ahead(executor, OPS, 2, stream, prefix, MBS)
    got = IterationState(2, MBS, None, None)
    assert ahead.take(got, stream) == len(prefix)
    ahead.finish(got)
    assert all(torch.equal(got.acts[(0, i.mb)], want.acts[(0, i.mb)]) for i in prefix if i.op is Op.FORWARD)


@pytest.mark.parametrize("change", ["iteration", "samples", "stream"])
def test_work_for_another_iteration_or_stream_is_dropped(executor, change):
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off")).streams[0]
    ahead = Ahead(executor, OPS, 2, stream, prefix_ahead(stream), MBS)
    iteration, mbs, runs = 2, MBS, stream
    if change == "iteration":
        iteration = 3
    elif change == "samples":
        mbs = range(0, 4)
    else:
        runs = [ir.load(1), Instr(Op.FORWARD, 0, 1)] + stream[2:]  # another microbatch first
    it = IterationState(iteration, mbs, None, None)
    assert ahead.take(it, runs) == 0
    assert not (it.acts or it.states or it.inputs or it.drawn) and it.busy == 0


def test_an_error_on_the_thread_is_raised_where_the_results_are_taken(executor):
    def broken(_executor, _ins):
        raise ValueError("broken forward")
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off")).streams[0]
    ahead = Ahead(executor, {**OPS, Op.FORWARD: broken}, 2, stream, prefix_ahead(stream), MBS)
    it = IterationState(2, MBS, None, None)
    assert ahead.take(it, stream) == 6
    with pytest.raises(ValueError, match="broken forward"):
        ahead.activation(2)  # the first send's forward
    with pytest.raises(ValueError, match="broken forward"):
        ahead.finish(it)


def test_an_error_in_work_that_is_dropped_is_not_raised(executor):
    def broken(_executor, _ins):
        raise ValueError("broken forward")
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off")).streams[0]
    ahead = Ahead(executor, {**OPS, Op.FORWARD: broken}, 2, stream, prefix_ahead(stream), MBS)
    assert ahead.take(IterationState(3, MBS, None, None), stream) == 0  # another iteration: not wanted


def test_with_the_sync_in_the_next_iteration_the_forward_after_the_late_sync_runs_ahead(executor):
    """Stage 0's stream begins with its late sync (the owner's send of the iteration
    before's gradients): what follows runs ahead, is taken as the main thread would
    have run it, and the sync goes first."""
    late = ScheduleOptions(redundancy="eager", sync="next")
    stream = compile_schedule(2, 4, (), options=late).streams[0]
    assert stream[0].op is Op.SEND_SYNC and prefix_ahead(stream) == _leading(stream, 1)
    n = len(prefix_ahead(stream))
    want = on_main_thread(executor, 2, stream[1:])
    ahead = Ahead(executor, OPS, 2, stream, prefix_ahead(stream), MBS)
    got = IterationState(2, MBS, None, None)
    assert ahead.take(got, stream) == n
    ahead.finish(got)
    assert torch.equal(got.acts[(0, 0)], want.acts[(0, 0)]) and sorted(got.drawn) == [2, 3]
    # an iteration that owes no sync (an epoch's first) begins with the same forwards: taken alike
    first = compile_schedule(2, 4, (), options=late.with_(sync="none")).streams[0]
    again, it = Ahead(executor, OPS, 2, stream, prefix_ahead(stream), MBS), IterationState(2, MBS, None, None)
    assert again.take(it, first) == n
    again.finish(it)


def test_dropped_work_stops_after_the_instruction_under_way(executor):
    """A recovery drops the work run ahead and should not wait for every forward of
    the prefix: the thread stops after the one it runs."""
    stream = compile_schedule(2, 4, (), options=ScheduleOptions(redundancy="off", ahead=True)).streams[0]
    began, release, ran = threading.Event(), threading.Event(), []

    def forward(shadow, ins):
        ran.append(ins.mb)
        began.set()
        release.wait(10)
        OPS[Op.FORWARD](shadow, ins)
    ahead = Ahead(executor, {**OPS, Op.FORWARD: forward}, 2, stream, prefix_ahead(stream), MBS)
    assert began.wait(10)
    ahead.cancelled.set()
    release.set()
    ahead.drop()
    assert ran == [0] and len([i for i in ahead.prefix if i.op is Op.FORWARD]) > 1
