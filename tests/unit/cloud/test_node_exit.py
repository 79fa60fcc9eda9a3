"""The node's end: which action each agent exit status takes."""
import pytest

from bamboo.control.exits import FENCED, PARKED
from cloud.node_exit import Action, decide


@pytest.mark.parametrize("status", [0, 1, FENCED, PARKED, -9])
def test_a_complete_job_finishes_whatever_the_status(status):
    assert decide(status, completed=True) is Action.FINISH


@pytest.mark.parametrize("status,action", [(0, Action.NOTHING), (1, Action.LEAVE), (2, Action.LEAVE),
                                           (FENCED, Action.REPLACE)])
def test_before_the_end(status, action):
    assert decide(status, completed=False) is action
