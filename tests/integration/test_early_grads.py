"""The last backward split: its input gradient sent before its weight gradients
(schedules/early_grads.py, --backward-split). The compiler's streams and their
simulated length against whole backwards and the closed form; then real workers,
whose training must be bit for bit the one with whole backwards, and survive a
SIGKILL between the two passes with the single-process reference's math."""
import pytest
import torch

from schedules.timing.checks import ValidationError
from schedules.compiler import compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.timing.engine import validate
from schedules.ir import Op, backward_input, backward_weight, send_grad
from schedules.lower import is_tail

from tests.training import bamboo_train
from schedules.options import ScheduleOptions

IDEAL = CostModel(forward=1.0, backward=2.0, transfer=0.0, step=0.0)


@pytest.mark.parametrize("mode", ["off", "lazy", "eager"])
@pytest.mark.parametrize("P,M", [(2, 2), (2, 8), (3, 5), (4, 8), (6, 12)])
def test_each_node_sends_its_input_gradients_a_weight_pass_before_its_whole_backward_would(mode, P, M):
    """Every node but the first splits its last `depth` backwards (one depth for
    all): each input pass followed by its send; each weight pass after the next
    split one's send, the last after the last send; after it only the tail (with
    eager, FRC that fits the node's end too)."""
    sched = compile_schedule(P, M, options=ScheduleOptions(redundancy=mode))
    depths = set()
    for node, stream in sched.streams.items():
        inputs = [i for i, x in enumerate(stream) if x.op is Op.BACKWARD_INPUT]
        weights = [i for i, x in enumerate(stream) if x.op is Op.BACKWARD_WEIGHT]
        if node == 0:  # stage 0 sends no gradient
            assert inputs == weights == []
            continue
        depths.add(len(inputs))
        mbs = list(range(M - len(inputs), M))
        assert [stream[i].mb for i in inputs] == mbs and [stream[i].mb for i in weights] == mbs
        assert all(stream[i + 1] == send_grad(node, stream[i].mb, node - 1) for i in inputs)
        assert all(inputs[k + 1] + 1 < weights[k] < (inputs + [len(stream)])[k + 2] for k in range(len(inputs) - 1))
        assert weights[-1] > inputs[-1] + 1
        assert all(is_tail(x) or x.redundant or x.op in (Op.LOAD, Op.SWAP_OUT, Op.BACKWARD_WEIGHT)
                   for x in stream[inputs[-1] + 2:])
        assert not any(x.op is Op.BACKWARD and not x.redundant and x.stage == node and x.mb in mbs for x in stream)
    assert len(depths) == 1 and depths.pop() >= 1


@pytest.mark.parametrize("M", [2, 3, 4, 8, 16])
def test_two_stages_reach_the_last_stages_own_work(M):
    """P=2 with stages alike: whole backwards take the 1F1B closed form, (M+1)(f+b).
    Split, stage 1 sends each gradient a weight pass earlier and stage 0 never
    waits on it: the iteration is the lower bound of stage 1's own work after the
    first activation reaches it, f + M(f+b) (every backward split)."""
    whole = simulate(compile_schedule(2, M, options=ScheduleOptions(redundancy="off", split="off"), cost=IDEAL), IDEAL).makespan
    sched = compile_schedule(2, M, options=ScheduleOptions(redundancy="off"), cost=IDEAL)
    split = simulate(sched, IDEAL).makespan
    assert whole == pytest.approx((M + 1) * 3.0)
    assert split == pytest.approx(1.0 + M * 3.0)
    assert sum(x.op is Op.BACKWARD_INPUT for x in sched.streams[1]) == M


@pytest.mark.parametrize("mode", ["off", "lazy", "eager"])
@pytest.mark.parametrize("P", [3, 4, 8, 12])
def test_deeper_pipelines_are_never_slower(mode, P):
    cost = CostModel(forward=[1.0 + 0.1 * s for s in range(P)], backward=[2.0 + 0.3 * s for s in range(P)])
    for M in (P, 2 * P, 4 * P):
        whole = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy=mode, split="off"), cost=cost)).makespan
        split = simulate(compile_schedule(P, M, options=ScheduleOptions(redundancy=mode), cost=cost)).makespan
        assert split < whole, (M, split, whole)


def test_a_node_with_work_after_its_last_send_keeps_whole_backwards():
    """Node 3 runs stages 3 and 0 after node 0 died: its last compute is stage 0's
    backward, which sends nothing; splitting its stage 3 backward would put the
    weight pass before that."""
    sched = compile_schedule(4, 8, failed=(0,), options=ScheduleOptions(redundancy="lazy"))
    assert not any(x.op is Op.BACKWARD_INPUT for x in sched.streams[3])
    assert any(x.op is Op.BACKWARD_INPUT for x in sched.streams[1])
    simulate(sched)


def test_the_validator_refuses_a_weight_pass_out_of_place():
    sched = compile_schedule(2, 4, options=ScheduleOptions(redundancy="off"), cost=IDEAL)
    s = list(sched.streams[1])
    at, before = s.index(backward_weight(1, 3)), s.index(backward_input(1, 3))
    early = {**sched.streams, 1: s[:before] + [s[at]] + s[before:at] + s[at + 1:]}  # before its input pass
    with pytest.raises(ValidationError):
        validate(sched.layout, 4, early)
    dropped = {**sched.streams, 1: s[:at] + s[at + 1:]}  # never: the microbatch is missing from the reduce
    with pytest.raises(ValidationError) as e:
        validate(sched.layout, 4, dropped)
    assert e.value.kind == "exactly-once"


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("P,M,d", [(2, 4, 1), (3, 5, 2), (4, 8, 1)])
def test_a_death_at_any_point_of_a_split_backward_is_recovered(mode, P, M, d):
    """Every cut of node d, the ones between its input and weight passes among them:
    the recovery validates, and its holder recomputes the dead stage's backward of
    every microbatch (the dead node's weight gradients died with it)."""
    base = compile_schedule(P, M, options=ScheduleOptions(redundancy=mode))
    at = base.streams[d].index(backward_weight(d, M - 1))
    for k in range(len(base.streams[d]) + 1):
        rec = compile_recovery(P, M, d, k, options=ScheduleOptions(redundancy=mode))
        assert all(simulate(rec).finished.values()), k
        part = rec.streams[(d - 1) % P][rec.resume_at[(d - 1) % P]:]
        if k == at:  # sent its last gradient, died before its weights
            assert sorted(x.mb for x in part if x.op is Op.BACKWARD and x.stage == d) == list(range(M))


# -- real workers ----------------------------------------------------------------------
COMMON = ["--model", "tiny", "--microbatches", "4", "--iterations", "4", "--seed", "5", "--stages", "2"]


def _train(tmp_path, name, *args):
    params = tmp_path / f"{name}-params"
    _, records = bamboo_train(tmp_path / f"{name}.jsonl", *COMMON, "--save-dir", str(params), *args)
    return [r["loss"] for r in records], {f.name: torch.load(f) for f in sorted(params.iterdir())}


@pytest.mark.slow
def test_split_backwards_train_the_same_bits_as_whole_ones(tmp_path):
    """float32, so that any change of summation order would show: the input gradient
    and the weights' come from the same autograd functions in the same order."""
    split_losses, split_params = _train(tmp_path, "split", "--redundancy", "off")
    whole_losses, whole_params = _train(tmp_path, "whole", "--redundancy", "off", "--backward-split", "off")
    assert split_losses == whole_losses and len(split_losses) == 4
    assert split_params.keys() == whole_params.keys() and len(split_params) > 1
    for name, state in split_params.items():
        for key, value in state.items():
            assert torch.equal(value, whole_params[name][key]), (name, key)


@pytest.mark.slow
def test_a_sigkill_between_the_input_and_the_weight_pass_keeps_the_math(tmp_path):
    """Node 1 sends its last input gradient and is killed before its weight pass:
    node 0 takes stage 1 over and recomputes its gradients; the training is the
    single-process reference's (float64: order noise far below the tolerance)."""
    stream = compile_schedule(2, 4, options=ScheduleOptions(redundancy="lazy")).streams[1]
    point = f"1@2:{stream.index(backward_weight(1, 3))}"
    losses, params = _train(tmp_path, "kill", "--redundancy", "lazy", "--dtype", "float64", "--preempt", point)
    ref_losses, ref_params = _train(tmp_path, "ref", "--dtype", "float64", "--stages", "1")
    assert losses == pytest.approx(ref_losses, rel=1e-9)
    assert params.keys() == ref_params.keys()
    for name, state in params.items():
        for key, value in state.items():
            torch.testing.assert_close(value, ref_params[name][key], rtol=1e-9, atol=1e-12)
