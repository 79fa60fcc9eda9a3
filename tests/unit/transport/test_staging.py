"""Copies between device and host (bamboo/transport/staging.py, bamboo/transport/swap.py): buffers
reused only once their copy finished, the GPU path's stream ordering run on the
CPU against a recording fake of torch.cuda, and the swap poison check."""
import contextlib

import pytest
import torch

from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage, dropout_seed
from bamboo.transport.staging import POISON, HostPool, Stager
from bamboo.transport.swap import PoisonReached, SavedTensors


class FakeCuda:
    """torch.cuda's streams and events, as a log of what was asked in which order."""

    def __init__(self):
        self.log, self.done, self.events = [], set(), 0
        self.main = self.Stream("main")

    def Stream(self, name="side"):  # noqa: N802 -- torch.cuda's name
        cuda = self

        class Stream:
            def wait_stream(self, other):
                cuda.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.name, event.n))
        stream = Stream()
        stream.name = name if isinstance(name, str) else "side"
        return stream

    def Event(self):  # noqa: N802
        cuda = self

        class Event:
            n = cuda.events

            def record(self, stream):
                cuda.log.append(("record_event", stream.name, self.n))

            def query(self):
                return self.n in cuda.done

            def synchronize(self):
                cuda.log.append(("synchronize", self.n))
        self.events += 1
        return Event()

    def current_stream(self, device=None):
        return self.main

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter", s.name))
        yield
        self.log.append(("exit", s.name))


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: cuda.log.append(("record_stream", s.name)),
                        raising=False)
    return cuda


def test_a_buffer_comes_back_only_after_the_copy_reading_it_finished(fake):
    pool = HostPool(pinned=False)
    a = pool.take((4,), torch.float32)
    event = fake.Event()
    pool.give(a, after=event)
    b = pool.take((4,), torch.float32)
    assert b.data_ptr() != a.data_ptr() and pool.allocated == 2
    fake.done.add(event.n)
    pool.give(b)
    again = {pool.take((4,), torch.float32).data_ptr() for _ in range(2)}
    assert again == {a.data_ptr(), b.data_ptr()} and pool.allocated == 2
    assert pool.take((4,), torch.float64).dtype == torch.float64 and pool.allocated == 3


def test_the_side_stream_waits_for_the_producer_and_the_host_never_waits(fake):
    stager = Stager(torch.device("cpu"), cuda=fake, streams=True)
    t = torch.arange(6.0)
    out = stager.to_host(t)
    assert torch.equal(out.tensor, t)
    assert fake.log == [("wait_stream", "side", "main"), ("enter", "side"), ("record_stream", "side"),
                        ("record_event", "side", 0), ("exit", "side")]
    fake.log.clear()
    back = stager.to_device(out.tensor)
    assert ("wait_stream", "side", "main") == fake.log[0] and ("record_event", "side", 1) in fake.log
    assert not any(e[0] == "synchronize" for e in fake.log)
    fake.log.clear()
    assert torch.equal(back.wait_here(), t)
    assert fake.log == [("wait_event", "main", 1)]  # the consumer's stream waits, not the host
    assert out.wait_host() is out.tensor and fake.log[-1] == ("synchronize", 0)


def _stage_and_grads():
    stage = Stage([ModelSource("tiny", seed=0).layer(i) for i in range(1, 4)])
    x, g = torch.randn(2, 32, 32), torch.randn(2, 32, 32)
    with dropout_seed(5):
        stage(x.requires_grad_()).backward(g)
    want = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad()
    return stage, x, g, want


def test_brc_after_a_swap_on_the_gpu_path_waits_for_the_copies_back(fake):
    stage, x, g, want = _stage_and_grads()
    stager = Stager(torch.device("cpu"), cuda=fake, streams=True)
    saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
    with dropout_seed(5), saved.recording():
        y = stage(x.detach().requires_grad_())
    saved.swap_out(stager)
    n = len(saved.host)
    saved.swap_in()
    assert not any(e[0] in ("wait_event", "synchronize") for e in fake.log)  # nothing waited yet
    y.backward(g)
    assert {e[2] for e in fake.log if e[0] == "wait_event"} == set(range(n, 2 * n))  # every copy back
    assert all(torch.equal(a, p.grad) for a, p in zip(want, stage.parameters()))


def test_host_buffers_are_reused_across_iterations():
    stage, x, g, want = _stage_and_grads()
    stager = Stager(torch.device("cpu"))
    for _ in range(3):
        saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
        with dropout_seed(5), saved.recording():
            stage(x.detach().requires_grad_())
        saved.swap_out(stager)
        n = len(saved.host)
        saved.release()  # BRC never ran: the buffers go back
    assert 0 < stager.pool.allocated == sum(map(len, stager.pool._free.values())) == n  # 3 rounds, one set


def test_poisoned_buffers_never_reach_brc_when_the_copies_are_ordered(monkeypatch):
    monkeypatch.setenv(POISON, "1")
    stage, x, g, want = _stage_and_grads()
    stager = Stager(torch.device("cpu"))
    for _ in range(2):  # the second round takes the first's buffers, poisoned again
        stage.zero_grad()
        saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
        with dropout_seed(5), saved.recording():
            y = stage(x.detach().requires_grad_())
        saved.swap_out(stager)
        saved.swap_in()
        y.backward(g)
        assert all(torch.equal(a, p.grad) for a, p in zip(want, stage.parameters()))
    assert stager.pool.poison


def test_a_copy_read_before_it_landed_is_caught_by_the_poison(monkeypatch):
    monkeypatch.setenv(POISON, "1")
    stage, x, g, _ = _stage_and_grads()
    stager = Stager(torch.device("cpu"))
    saved = SavedTensors({p.data_ptr() for p in stage.parameters()})
    with dropout_seed(5), saved.recording():
        y = stage(x.detach().requires_grad_())
    saved.swap_out(stager)
    saved.host[0].tensor.fill_(float("nan"))  # as if the copy out had not landed yet
    saved.swap_in()
    with pytest.raises(PoisonReached):
        y.backward(g)


class _SavesAHostScalar(torch.autograd.Function):
    """Saves, beside its input, a tensor on another device than the stage's, as CUDA
    attention saves its RNG seed and offset in host memory beside GPU tensors."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, torch.empty((), device="meta"))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, seed = ctx.saved_tensors
        assert seed.device.type == "meta" and x.device.type == "cpu"
        return g * 2


def test_a_tensor_saved_off_the_stages_device_stays_where_it_is(fake):
    stager = Stager(torch.device("cpu"), cuda=fake, streams=True)  # "meta" plays the host beside a GPU stage
    x = torch.randn(3, requires_grad=True)
    saved = SavedTensors(set())
    with saved.recording():
        y = _SavesAHostScalar.apply(x)
    saved.swap_out(stager)
    assert saved.moved == [True, False] and stager.pool.allocated == 1  # only the stage's own tensor copied
    saved.swap_in()
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    given = []
    stager.release = given.extend  # what goes back to the pool
    saved.swap_out(stager)
    saved.release()
    assert [c.tensor.device.type for c in given] == ["cpu"]  # the copy of x alone, not the kept tensor


def test_the_poison_check_reads_only_the_swapped_tensors(fake, monkeypatch):
    monkeypatch.setenv(POISON, "1")
    stager = Stager(torch.device("cpu"), cuda=fake, streams=True)
    x = torch.randn(3, requires_grad=True)
    saved = SavedTensors(set())
    with saved.recording():
        y = _SavesAHostScalar.apply(x)
    saved.swap_out(stager)
    saved.swap_in()
    y.sum().backward()  # a kept meta tensor has no values to read: the check must not touch it
    assert torch.equal(x.grad, torch.full((3,), 2.0))
