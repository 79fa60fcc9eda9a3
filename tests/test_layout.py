"""Who owns what after failures."""
import pytest

from schedules.layout import Group, Layout, ScheduleError


def test_fault_free_layout_is_identity_with_cyclic_replicas():
    L = Layout(4)
    assert [L.owner(s) for s in range(4)] == [0, 1, 2, 3]
    assert [L.replica(n) for n in range(4)] == [1, 2, 3, 0]
    assert [L.holder(s) for s in range(4)] == [3, 0, 1, 2]
    assert L.groups() == [Group(n, (n,)) for n in range(4)]


def test_predecessor_takes_over_and_loses_its_replica_duty():
    L = Layout(5, {2})
    assert L.owned(1) == (1, 2)
    assert L.replica(1) is None          # stage 2 is its own now; stage 3 was never its
    assert L.holder(2) is None and L.holder(3) is None
    assert L.replica(0) == 1
    assert L.groups() == [Group(0, (0,)), Group(1, (1, 2)), Group(3, (3,)), Group(4, (4,))]


def test_first_node_failure_gives_last_node_two_groups():
    L = Layout(4, {0})
    assert L.owned(3) == (0, 3)
    groups = L.groups()
    assert groups[0] == Group(3, (0,)) and groups[-1] == Group(3, (3,))


@pytest.mark.parametrize("P,failed", [(4, {1, 2}), (4, {3, 0}), (2, {0, 1}), (6, {5, 0})])
def test_adjacent_failures_are_refused(P, failed):
    with pytest.raises(ScheduleError, match="adjacent"):
        Layout(P, failed)


def test_out_of_range_and_tiny_pipelines_are_refused():
    with pytest.raises(ScheduleError, match="out of range"):
        Layout(4, {4})
    with pytest.raises(ScheduleError, match="at least 2"):
        Layout(1)
