"""The message protocol of bamboo/transport/comm.py: a payload's receive is posted with its
header's, into room for the channel's largest payload so far; a larger payload is
preceded by an empty message. Every message must arrive whole, in order, with its
note, whatever the sequence of sizes, and the receive buffers must never be reused
under a tensor already handed out."""
import torch

from schedules.ir import Op

from tests.gloo import comm_pair, gloo_pair


def test_gloo_takes_a_shorter_message_into_a_longer_receive():
    """What the protocol rests on (gloo's TCP transport checks length <= the receive's
    size): a torch upgrade that changes it fails here first."""
    a, b = gloo_pair()
    room = torch.full((64,), 7, dtype=torch.uint8)
    receive = b.recv([room], 0, 5)
    a.send([torch.arange(3, dtype=torch.float64)], 1, 5).wait()
    receive.wait()
    assert room[:24].view(torch.float64).tolist() == [0.0, 1.0, 2.0]
    assert room[24:].tolist() == [7] * 40  # nothing written past the message
    empty = b.recv([torch.zeros(8, dtype=torch.uint8)], 0, 5)
    a.send([torch.empty(0, dtype=torch.uint8)], 1, 5).wait()
    empty.wait()  # an empty message fills a receive of any size


def test_messages_of_changing_sizes_arrive_whole_in_order_with_their_notes():
    sender, receiver = comm_pair()
    g = torch.Generator().manual_seed(0)
    sent = [torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g),  # the room grows, then fits
            torch.randn(2, 3, generator=g),                                  # shorter than the room
            torch.randn(16, 8, generator=g, dtype=torch.float64),            # grows again, another dtype
            torch.empty(0, 5), torch.tensor(3.5),                            # empty, and a scalar
            torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.randn(16, 8, generator=g)]
    receiver.expect(10, Op.SEND_GRAD, len(sent))
    for i, t in enumerate(sent):
        sender.post(20, Op.SEND_GRAD, t, note=float(i) if i % 2 else None)
    got = [receiver.recv_noted(10, Op.SEND_GRAD) for _ in sent]
    sender.flush(lambda peer: False)
    for i, ((t, note), want) in enumerate(zip(got, sent)):
        assert t.shape == want.shape and t.dtype == want.dtype, i
        torch.testing.assert_close(t, want, rtol=0, atol=0)
        assert note == (float(i) if i % 2 else None)
    # every tensor handed out still holds its message: no buffer was reused under it
    for (t, _), want in zip(got, sent):
        torch.testing.assert_close(t, want, rtol=0, atol=0)


def test_channels_in_both_directions_keep_their_rooms_apart():
    """Activations one way and gradients the other, each with its own sizes, interleaved."""
    left, right = comm_pair()
    acts = [torch.full((n, 4), float(n)) for n in (3, 1, 5, 5, 2)]
    grads = [torch.full((n,), -float(n)) for n in (7, 9, 2, 9, 1)]
    right.expect(10, Op.SEND_ACT, len(acts))
    left.expect(20, Op.SEND_GRAD, len(grads))
    for act, grad in zip(acts, grads):
        left.post(20, Op.SEND_ACT, act)
        right.post(10, Op.SEND_GRAD, grad)
        torch.testing.assert_close(right.recv(10, Op.SEND_ACT), act, rtol=0, atol=0)
        torch.testing.assert_close(left.recv(20, Op.SEND_GRAD), grad, rtol=0, atol=0)
    left.flush(lambda peer: False)
    right.flush(lambda peer: False)


def test_an_activation_kept_by_its_sender_is_the_host_copy_it_was_sent_from(monkeypatch):
    """Lazy on a GPU with gloo keeps each activation it sends in host memory (the
    replica's input). The GPU path, run on the CPU against a recording fake of
    torch.cuda: one copy to the host per message, the kept one included, and the
    outbox gives back to the pool the buffers of the messages not kept, never the
    kept one (its keeper gives it back)."""
    from bamboo.transport.comm import Comm
    from bamboo.transport.staging import Stager
    from tests.gloo import gloo_pair
    from tests.unit.transport.test_staging import FakeCuda

    cuda = FakeCuda()
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None, raising=False)
    a, b = gloo_pair()
    stager = Stager(torch.device("cpu"), cuda=cuda, streams=True)
    sender = Comm(a, {10: 0, 20: 1}, torch.device("cpu"), stager=stager)
    receiver = Comm(b, {10: 0, 20: 1}, torch.device("cpu"))
    act = torch.randn(4, 8)
    receiver.expect(10, Op.SEND_ACT, 2)
    kept = sender.post(20, Op.SEND_ACT, act, keep=True)
    plain = sender.post(20, Op.SEND_ACT, act * 2, keep=False)
    got = [receiver.recv(10, Op.SEND_ACT) for _ in range(2)]
    sender.flush(lambda peer: False)
    assert plain is None and kept is not None
    assert [e for e in cuda.log if e == ("enter", "side")] == [("enter", "side")] * 2  # two copies, not three
    torch.testing.assert_close(got[0], act, rtol=0, atol=0)
    torch.testing.assert_close(got[1], act * 2, rtol=0, atol=0)
    torch.testing.assert_close(kept.tensor, act, rtol=0, atol=0)  # what the sender keeps: the message
    free = [buf for bufs in stager.pool._free.values() for buf in bufs]
    assert len(free) == 1 and free[0] is not kept.tensor and torch.equal(free[0], act * 2)
