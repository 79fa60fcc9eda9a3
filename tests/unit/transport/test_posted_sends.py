"""Posted sends (Comm.post): the sender goes on before the receiver takes the
message, messages keep their order and notes, and `flush` learns every outcome."""
import random
import threading

import pytest
import torch

from schedules.ir import Instr, Op
from schedules.recovery import sends_first

from bamboo.transport.comm import PeerFailure
from tests.gloo import comm_pair


def test_posts_return_before_the_receiver_asks_and_arrive_in_order_with_their_notes():
    sender, receiver = comm_pair()
    sent = [torch.randn(4, 8) for _ in range(3)]
    posted = threading.Event()

    def post_all():
        for i, t in enumerate(sent):
            sender.post(20, Op.SEND_GRAD, t, note=0.5 * i if i else None)
        posted.set()
    threading.Thread(target=post_all, daemon=True).start()
    # The receiver has not asked for anything yet: a send that waited for it would never return.
    assert posted.wait(timeout=30), "post waited for the receiver"
    receiver.expect(10, Op.SEND_GRAD, 3)
    got = [receiver.recv_noted(10, Op.SEND_GRAD) for _ in sent]
    sender.flush(lambda peer: False)
    assert not sender.pending()
    for (t, note), want, i in zip(got, sent, range(3)):
        torch.testing.assert_close(t, want, rtol=0, atol=0)
        assert note == (0.5 * i if i else None)


def test_flush_gives_up_on_a_peer_recorded_dead_and_drops_its_sends():
    sender, receiver = comm_pair()  # the receiver takes nothing until the end: as good as dead
    sender.post(20, Op.SEND_ACT, torch.ones(2))
    sender.post(20, Op.SEND_ACT, torch.ones(2))
    assert sender.pending()
    asked = []
    with pytest.raises(PeerFailure) as failure:
        sender.flush(lambda peer: asked.append(peer) or True)
    assert failure.value.node == 20 and asked == [20]
    assert not sender.pending()
    sender.flush(lambda peer: pytest.fail("nothing is left to wait for"))
    receiver.expect(10, Op.SEND_ACT, 2)  # lets the outbox finish before the process exits
    assert [receiver.recv(10, Op.SEND_ACT).tolist() for _ in range(2)] == [[1.0, 1.0]] * 2


def test_sends_first_moves_only_ready_sends_and_keeps_every_channels_order():
    """schedules/recovery.py's sends_first, against a brute force: over random
    recovery tails, the result is a permutation of the tail; every channel's sends
    and every other instruction keep their order; a send moved ahead was ready and
    had no send of its channel not ready before it; and nothing else moved ahead."""
    rng = random.Random(0)
    ops = [Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_SYNC, Op.RECV_GRAD, Op.BACKWARD, Op.REDUCE_GRADS]
    for _ in range(300):
        tail = [Instr(rng.choice(ops), rng.randrange(3), rng.randrange(4), rng.randrange(2)) for _ in range(12)]
        ready_set = {i for i, ins in enumerate(tail) if rng.random() < 0.6}
        ready = {id(tail[i]) for i in ready_set}
        out = sends_first(tail, lambda ins: id(ins) in ready)
        assert sorted(map(id, out)) == sorted(map(id, tail))
        sends = (Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_SYNC)
        for channel in {(x.op, x.peer) for x in tail if x.op in sends}:
            assert [id(x) for x in out if (x.op, x.peer) == channel] == \
                [id(x) for x in tail if (x.op, x.peer) == channel]
        assert [id(x) for x in out if x.op not in sends] == [id(x) for x in tail if x.op not in sends]
        moved = []
        for i, ins in enumerate(tail):  # brute force: which sends may go first
            earlier = [t for t in tail[:i] if (t.op, t.peer) == (ins.op, ins.peer)]
            if ins.op in (Op.SEND_ACT, Op.SEND_GRAD) and i in ready_set and all(id(t) in ready for t in earlier):
                moved.append(id(ins))
        assert [id(x) for x in out[:len(moved)]] == moved
