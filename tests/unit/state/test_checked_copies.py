"""A rollback from memory takes layers from peers over gloo, which nothing
authenticates: each copy is checked against the hash the committed checkpoint's
record holds (written to storage by the layer's owner), and one that differs is
read from storage instead."""
from bamboo.control.config import JobConfig
from bamboo.data.checkpoint_files import Attempt, write_part
from bamboo.state.checkpoint import Checkpoints
from bamboo.state.epochs import EpochMoves


class _Moves(EpochMoves):
    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints, self.node = checkpoints, 3


def test_a_copy_that_differs_from_the_committed_checkpoint_is_read_from_storage(tmp_path, capsys):
    checkpoints = Checkpoints(JobConfig.of(checkpoint=str(tmp_path), layers=3), 0, 3)
    stored = {i: b"layer %d" % i for i in range(3)}
    write_part(checkpoints.storage, Attempt(4, "run-e000001"), 0, stored, layers=3)
    moves = _Moves(checkpoints)
    assert moves._checked_copies(4, {0: stored[0], 2: stored[2]}) == {0: stored[0], 2: stored[2]}
    assert capsys.readouterr().err == ""
    assert moves._checked_copies(4, {0: stored[0], 1: b"crafted by someone on the network"}) == \
        {0: stored[0], 1: stored[1]}
    assert "copies of layers [1] differ" in capsys.readouterr().err


def test_copies_of_a_checkpoint_not_committed_yet_are_taken_as_they_are(tmp_path):
    """The write goes on behind the training: a rollback right after it finds no commit."""
    checkpoints = Checkpoints(JobConfig.of(checkpoint=str(tmp_path), layers=3), 0, 3)
    write_part(checkpoints.storage, Attempt(6, "run-e000001"), 0, {0: b"a"}, layers=3)  # a part, no commit
    assert _Moves(checkpoints)._checked_copies(6, {0: b"a", 1: b"b"}) == {0: b"a", 1: b"b"}
