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


def _subsets(P):
    return [frozenset(n for n in range(P) if mask >> n & 1) for mask in range(1 << P)]


def _holds(P, node, replicas):
    """Brute force: a node keeps its own stage's layers and, with replicas, its successor's."""
    return {node, (node + 1) % P} if replicas else {node}


@pytest.mark.parametrize("replicas", [True, False])
@pytest.mark.parametrize("P", range(2, 7))
def test_lost_is_every_stage_no_live_node_holds(P, replicas):
    for failed in _subsets(P):
        alive = [n for n in range(P) if n not in failed]
        expected = {s for s in range(P) if not any(s in _holds(P, n, replicas) for n in alive)}
        assert Layout.lost(P, failed, replicas) == expected, (P, sorted(failed), replicas)
        assert Layout.lost(P, sorted(failed), replicas) == expected  # any iterable of nodes


def test_lost_examples():
    assert Layout.lost(4, {1, 2}) == {2}
    assert Layout.lost(4, {3, 0}) == {0}     # cyclic: node 3 held stage 0
    assert Layout.lost(4, {0, 2}) == set()   # each predecessor is alive
    assert Layout.lost(4, {0, 2}, replicas=False) == {0, 2}
    assert Layout.lost(3, {0, 1, 2}) == {0, 1, 2}
    assert Layout.lost(5, set()) == set()


@pytest.mark.parametrize("replicas", [True, False])
@pytest.mark.parametrize("P", range(2, 7))
def test_held_matches_brute_force_and_covers_what_a_node_computes(P, replicas):
    for failed in _subsets(P):
        alive = [n for n in range(P) if n not in failed]
        if not alive or any((n + 1) % P in failed for n in failed):
            continue  # a layout with a stage lost: refused
        L = Layout(P, failed, replicas)
        for n in alive:
            held = L.held(n)
            assert held == tuple(sorted(_holds(P, n, replicas))), (P, sorted(failed), replicas, n)
            if replicas or not failed:  # (without replicas a failed node's stage has no holder)
                assert set(L.owned(n)) <= set(held)
            if L.replica(n) is not None:
                assert L.replica(n) in held
        if replicas:  # every stage is still held by some live node
            assert set().union(*(L.held(n) for n in alive)) == set(range(P))
