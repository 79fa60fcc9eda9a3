"""What a node lends and whom a holder asks for a death in a late sync's window
(bamboo/runtime/lending.py), without processes: the lenders of a stage against a
brute force over the assignment, and what is held for which iteration. The loans
themselves cross real processes in tests/integration/test_late_sync_pipelines.py."""
import itertools

import torch

from bamboo.control.assignment import Assignment
from bamboo.runtime.lending import KEPT, REDUCED_SUM, Loans
from schedules.ir import Op, send_sync

PIPELINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8))


def loans(pipelines=PIPELINES, replicas=True, copies=False) -> Loans:
    modules = {0: torch.nn.Linear(2, 2)}
    return Loans(None, Assignment(0, 0, pipelines), 1, modules, replicas, copies)


def owns(assignment: Assignment, node: int, stage: int, failed) -> bool:
    """Brute force: `node` runs `stage` as its owner when `failed` died (it holds the
    stage and its place is the stage's, or the stage's owner before it died); a
    pipeline with two neighbours dead lost a stage and runs nothing."""
    j = next(j for j, p in enumerate(assignment.pipelines) if node in p)
    pipe = assignment.pipelines[j]
    if any(pipe[s] in failed and pipe[(s + 1) % len(pipe)] in failed for s in range(len(pipe))):
        return False
    owner = pipe[stage]
    if owner not in failed:
        return owner == node
    before = pipe[(stage - 1) % len(pipe)]  # its predecessor took it over, unless it died too
    return before == node and before not in failed


def test_the_lenders_are_the_other_pipelines_live_owners_of_the_stage():
    lender = loans()
    nodes = [n for p in PIPELINES for n in p]
    for failed in itertools.chain([()], itertools.combinations(nodes, 1), itertools.combinations(nodes, 2)):
        for stage, mine in itertools.product(range(3), range(3)):
            got = lender.lenders(stage, set(failed), mine)
            want = [n for j, p in enumerate(PIPELINES) if j != mine for n in p
                    if n not in failed and owns(lender.assignment, n, stage, set(failed))]
            assert got == want, (failed, stage, mine)


def test_one_pipeline_or_no_replicas_lend_nothing_and_keep_nothing():
    for lender in (loans(pipelines=PIPELINES[:1]), loans(replicas=False)):
        lender.keep(KEPT, 0, 3, torch.ones(2))
        assert not lender.lends and lender.held == {}
        counts = {Op.SEND_ACT.value: 1}
        assert lender.late_sync([send_sync(0, 1)], 1, counts, 0, alive=None) is counts  # nothing asked


def test_kept_gradients_are_held_through_the_next_iteration_and_a_sum_is_copied_before_its_scaling():
    lender = loans(copies=True)
    kept, total = torch.ones(4), torch.full((4,), 2.0)
    lender.begin(2, comm=None)
    lender.keep(KEPT, 0, 3, kept)            # stepped in iteration 2: lent in iteration 3
    lender.keep(REDUCED_SUM, 0, 2, total)    # reduced in iteration 2
    total.mul_(0.5)                          # the step's clipping scales the gradients in place
    assert torch.equal(lender.held[(REDUCED_SUM, 0, 2)], torch.full((4,), 2.0))
    assert lender.held[(KEPT, 0, 3)] is kept  # not copied: nothing changes it after the step
    lender.begin(3, comm=None)
    assert set(lender.held) == {(KEPT, 0, 3)}
    lender.begin(4, comm=None)
    assert lender.held == {}


def test_a_sync_that_landed_is_not_borrowed():
    lender = loans()
    counts = {Op.SEND_SYNC.value: 1}
    assert lender.late_sync([send_sync(0, 1)], 1, counts, 0, alive=None) is counts
