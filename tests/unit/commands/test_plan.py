"""--plan's arithmetic against independent counts: parameters counted on the
model's own layers, the textbook 1F1B figures, and the command's refusals."""
import pytest

from bamboo.model.activations import Bytes, LayerBytes
from bamboo.model.api import ModelSource
from bamboo.model.partition import partition
from commands.train import cli
from commands.train.flags import build_parser
from commands.train.instances import GIB
from commands.train.plan import Target, make_plan


def config(*flags):
    return cli.config_from_args(build_parser().parse_args(list(flags)), remote=True)


def flat(saved: int, owed: int = 0, output: int = 0) -> LayerBytes:
    """A layer that keeps `saved` bytes per microbatch whatever its shape."""
    return LayerBytes(Bytes(saved, 0, 0, 0), Bytes(saved, 0, 0, 0), Bytes(owed, 0, 0, 0), output)


def test_the_states_are_the_stages_and_replicas_parameters_counted_on_the_layers():
    cfg = config("--model", "hf:llama-tiny", "--seq", "64", "--stages", "4", "--microbatches", "8",
                 "--local-nodes", "8")
    source = ModelSource.of(cfg.model)
    layers = [source.layer(i) for i in range(source.count)]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    ranges = partition(counts, 4)
    per_stage = [sum(counts[i] for i in r) for r in ranges]
    plan = make_plan(cfg, source.costs(), [flat(0)] * source.count, (8, 64))
    for s, m in enumerate(plan.stages):
        held = per_stage[s] + per_stage[(s + 1) % 4]
        assert m.device["weights"] == m.device["gradients"] == 4 * held
        assert m.device["AdamW moments"] == 8 * held
        assert m.device["undo copies (agents)"] == 12 * held   # agents: parameters and moments before each step
        assert m.device["sync message"] == m.device["reduce copy"] == 4 * per_stage[s]  # two pipelines
    assert plan.params == sum(counts)
    assert plan.links["replica syncs"] == 2 * 4 * sum(counts)
    assert plan.links["data-parallel reduce"] == 2 * (2 - 1) * 4 * sum(counts)


@pytest.mark.parametrize("P,m", [(4, 8), (4, 2), (3, 5)])
def test_plain_1f1b_holds_min_of_p_minus_s_and_m_microbatches_and_idles_the_textbook_bubble(P, m):
    cfg = config("--model", "tiny", "--stages", str(P), "--microbatches", str(m), "--redundancy", "off",
                 "--backward-split", "off")
    costs = [1.0] * (3 * P)  # equal stages
    plan = make_plan(cfg, costs, [flat(1000)] * (3 * P), (P, 32))
    for s, stage in enumerate(plan.stages):
        assert stage.device["activations"] == min(P - s, m) * 3 * 1000
        assert stage.device["undo copies (agents)"] == stage.device["sync message"] == 0  # no agents, no replica
    assert plan.bubble == pytest.approx((P - 1) / (m + P - 1))


def test_a_split_backward_holds_the_gradients_owed_to_its_weight_pass():
    common = ("--model", "tiny", "--stages", "4", "--microbatches", "8", "--redundancy", "off")
    whole = make_plan(config(*common, "--backward-split", "off"), [1.0] * 8, [flat(1000, owed=300)] * 8, (4, 32))
    split = make_plan(config(*common), [1.0] * 8, [flat(1000, owed=300)] * 8, (4, 32))
    last = split.stages[-1].device["activations"]
    assert whole.stages[-1].device["activations"] == 2 * 1000
    assert last >= 2 * 1000 + 2 * 300  # at least one weight pass owed beside the microbatch in flight
    assert split.bubble < whole.bubble


def test_eager_swaps_every_frc_forward_with_frc_all():
    cfg = config("--model", "tiny", "--stages", "4", "--microbatches", "8", "--frc", "all")
    plan = make_plan(cfg, [1.0] * 8, [flat(1000, output=10)] * 8, (4, 32))
    for stage in plan.stages:  # each FRC forward's activations and its output, all 8 at once by the tail
        assert stage.host["FRC swapped"] == 8 * (2 * 1000 + 10 * 2 * 32)  # the output: 10 bytes a token


def test_misfit_names_the_fullest_stage_and_the_margin():
    cfg = config("--model", "tiny", "--stages", "2", "--microbatches", "4")
    plan = make_plan(cfg, [1e6] * 8, [flat(0)] * 8, (2, 32))
    worst = plan.worst()
    room = worst.gpu_total + int(0.5 * GIB)
    assert plan.misfit(Target("roomy", room, None)) is None
    why = plan.misfit(Target("tight", room - 1, None))
    assert why.startswith(f"stage {worst.stage} needs") and "tight" in why
    assert "host memory" in plan.misfit(Target("no host", room, 2 * GIB, 1))  # a worker's process alone is 3 GiB


def run(capsys, *flags):
    code = cli.main(list(flags))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_prints_the_table_and_refuses_a_layout_that_does_not_fit(capsys):
    code, out, err = run(capsys, "--model", "tiny", "--stages", "2", "--plan", "--gpu-memory", "0.5")
    assert code == 2 and err.count("\n") == 1 and "--plan: stage" in err and "--propose" in err
    assert "per GPU (GiB)" in out and "bubble:" in out and "network per iteration" in out
    code, out, err = run(capsys, "--model", "tiny", "--stages", "2", "--plan", "--gpu-memory", "16")
    assert code == 0 and "fits 16 GiB GPUs" in out and err == ""


def test_llama_1b_on_a10g(capsys):
    common = ("--model", "hf:llama-1b", "--seq", "2048", "--stages", "4", "--microbatches", "16",
              "--local-nodes", "16", "--plan", "--instance-type", "g5.xlarge")
    code, out, err = run(capsys, *common, "--batch", "1")
    assert code == 0 and "fits g5.xlarge (A10G)" in out
    code, out, err = run(capsys, *common, "--batch", "4")
    assert code == 2 and "more than g5.xlarge (A10G)'s 22.5 GiB" in err


def test_each_proposed_layout_passes_its_own_plan(capsys):
    common = ("--model", "hf:llama-tiny", "--seq", "128", "--local-nodes", "4", "--plan", "--gpu-memory", "0.53")
    code, out, err = run(capsys, *common, "--stages", "2", "--microbatches", "2", "--batch", "8", "--propose")
    assert code == 2 and "--plan: stage" in err
    proposed = [line.split(":")[1].split() for line in out.splitlines() if line.startswith("fits: ")]
    assert 1 <= len(proposed) <= 3
    for flags in proposed:  # the same 16 sequences an iteration
        assert int(flags[flags.index("--microbatches") + 1]) * int(flags[flags.index("--batch") + 1]) == 16
        assert run(capsys, *common, *flags)[0] == 0, flags


@pytest.mark.parametrize("flags,message", [
    (["--propose"], "--propose goes with --plan"),
    (["--plan", "--gpu-memory", "-1"], "--gpu-memory must be a positive number"),
    (["--plan", "--instance-type", "g5.xlarge", "--gpu-memory", "8"], "--instance-type sets the GPU"),
])
def test_bad_planning_flags_are_one_line(capsys, flags, message):
    code, out, err = run(capsys, "--model", "tiny", *flags)
    assert code == 2 and message in err and err.count("\n") == 1
