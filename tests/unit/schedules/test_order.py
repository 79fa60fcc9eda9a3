"""Pass (a): compute-only orders, checked against what 1F1B and GPipe mean."""
import pytest

from schedules.order import gpipe, one_f_one_b


@pytest.mark.parametrize("order", [one_f_one_b, gpipe])
@pytest.mark.parametrize("V,M", [(2, 1), (4, 8), (8, 3), (5, 5)])
def test_every_microbatch_forward_then_backward_once(order, V, M):
    for v in range(V):
        steps = order(V, M, v)
        assert sorted(steps) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
        assert all(steps.index(("F", m)) < steps.index(("B", m)) for m in range(M))
        # microbatches flow in order through each kind
        assert [m for k, m in steps if k == "F"] == list(range(M))
        assert [m for k, m in steps if k == "B"] == list(range(M))


def _peak_in_flight(steps):
    live = peak = 0
    for kind, _ in steps:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("V,M", [(4, 8), (8, 16), (3, 2)])
def test_1f1b_bounds_live_microbatches_gpipe_does_not(V, M):
    for v in range(V):
        assert _peak_in_flight(one_f_one_b(V, M, v)) == min(V - v, M)
        assert _peak_in_flight(gpipe(V, M, v)) == M


def test_1f1b_warmup_then_alternates():
    steps = one_f_one_b(4, 8, 1)  # warm-up of 4-1-1 = 2 forwards
    assert steps[:2] == [("F", 0), ("F", 1)]
    assert steps[2:8] == [("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2)]
