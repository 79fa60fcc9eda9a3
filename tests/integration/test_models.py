"""Models, data and partitioning, against plain single-module computations."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from bamboo.data.corpus import ByteCorpus, DataError, split_microbatches
from bamboo.model.api import ModelError, ModelSource
from bamboo.model.builtin import Stage, dropout_seed
from bamboo.model.factory import FactoryModel, layer_items
from bamboo.model.partition import PartitionError, partition
from tests.training import train_refusal


def brute_force_partition(costs, stages):
    import itertools
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs,stages", [([1] * 8, 4), ([5, 1, 1, 1, 1, 5], 3), ([9, 1, 1, 1, 1, 1, 1, 9, 2], 4),
                                          ([3, 1, 4, 1, 5, 9, 2, 6], 5)])
def test_partition_is_optimal_and_contiguous(costs, stages):
    ranges = partition(costs, stages)
    assert [r.start for r in ranges][0] == 0 and ranges[-1].stop == len(costs)
    assert all(a.stop == b.start and len(a) > 0 for a, b in zip(ranges, ranges[1:]))
    assert max(sum(costs[i] for i in r) for r in ranges) == brute_force_partition(costs, stages)


def test_partition_refuses_more_stages_than_layers():
    with pytest.raises(PartitionError, match="more than the model's 3 layers"):
        partition([1, 2, 3], 4)


def test_corpus_is_deterministic_and_shifted(tmp_path):
    corpus = ByteCorpus(seq=16, batch=3, seed=7)
    x, y = corpus.microbatch(4, 2)
    x2, y2 = ByteCorpus(seq=16, batch=3, seed=7).microbatch(4, 2)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(corpus.microbatch(4, 3)[0], x)
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(DataError, match="fewer than one sequence"):
        ByteCorpus([small], seq=16)
    with pytest.raises(DataError, match="cannot read"):
        ByteCorpus([tmp_path / "missing.txt"])


def test_microbatches_split_evenly_in_order():
    assert split_microbatches(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]


def test_stages_chained_equal_the_whole_model():
    source = ModelSource("tiny", seed=1)
    layers = [source.layer(i) for i in range(source.count)]
    whole = Stage(layers, source.loss)
    x, y = ByteCorpus(seq=32, batch=2, seed=1).microbatch(0, 0)
    ranges = partition(source.costs(), 3)
    parts = [Stage([layers[i] for i in r], source.loss if k == 2 else None, r.start) for k, r in enumerate(ranges)]
    with dropout_seed(11):
        expected = whole(x, y)
        h = x
        for part in parts[:-1]:
            h = part(h)
        got = parts[-1](h, y)
    assert torch.equal(got, expected)


def test_plain_dropout_repeats_under_the_same_seed():
    stage = Stage([nn.Linear(8, 8), nn.Dropout(0.5)], first_layer=3)
    x = torch.randn(4, 8)
    with dropout_seed(5):
        a = stage(x)
    with dropout_seed(5):
        b = stage(x)
    with dropout_seed(6):
        c = stage(x)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_built_in_layers_depend_only_on_seed_and_index():
    a, b = ModelSource("tiny", seed=2).layer(3), ModelSource("tiny", seed=2).layer(3)
    c = ModelSource("tiny", seed=3).layer(3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_factory_models_and_errors():
    src = ModelSource("tests.sample_models:byte_mlp", seed=0)
    assert src.count == 6 and len(src.costs()) == 6
    with pytest.raises(ModelError, match="not an nn.Module|must return"):
        ModelSource("tests.sample_models:not_a_model", seed=0)
    with pytest.raises(ModelError, match="cannot load"):
        ModelSource("tests.sample_models:missing", seed=0)
    with pytest.raises(ModelError, match="neither a built-in"):
        ModelSource("gpt5", seed=0)


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_deepspeed_pipeline_module_gives_the_same_loss():
    """A real PipelineModule (DeepSpeed initialised on a one-process gloo group): its
    own forward and loss against the stages Bamboo builds from its layer specs."""
    code = r'''
import os, socket, torch
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from deepspeed.pipe import PipelineModule
from tests.sample_models import layer_specs
from bamboo.model.factory import layer_items
from bamboo.model.builtin import Stage
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
torch.manual_seed(0)
pm = PipelineModule(layers=layer_specs(), num_stages=1, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(
    out.reshape(-1, 256), y.reshape(-1)))
x = torch.randint(0, 256, (2, 8)); y = torch.randint(0, 256, (2, 8))
want = pm.loss_fn(pm(x), y)
layers, loss = layer_items(pm)
got = Stage(layers[2:], loss)(Stage(layers[:2])(x), y)
assert len(layers) == 4 and torch.equal(got, want), (got, want)
print("same", float(got))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    assert out.returncode == 0 and "same" in out.stdout, out.stderr[-2000:]


def test_layer_specs_build_without_deepspeed_initialised():
    pytest.importorskip("deepspeed")
    from tests.sample_models import layer_specs
    model = FactoryModel("specs", layer_specs, seed=0)
    assert [type(model.build(i)).__name__ for i in range(4)] == ["Tokens", "Linear", "ReLU", "Linear"]
    assert model.loss is None


@pytest.mark.parametrize("name,millions", [("tiny", 0.0937), ("gpt2-small", 163.04), ("bert-large", 365.34)])
def test_built_in_sizes(name, millions):
    assert sum(ModelSource(name, seed=0).costs()) / 1e6 == pytest.approx(millions, rel=1e-3)


def test_a_factory_layer_is_new_each_time_so_a_rebuild_is_pristine():
    """Going back to the job's start rebuilds layers from the source: a factory's
    layer trained in place must not be what the rebuild gets (built-ins are built
    anew from (seed, index) anyway)."""
    source = ModelSource("tests.sample_models:byte_mlp", seed=4)
    trained = source.layer(1)
    first = {k: v.clone() for k, v in trained.state_dict().items()}
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    rebuilt = source.layer(1)
    assert rebuilt is not trained
    for k, v in rebuilt.state_dict().items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)


def test_a_factory_model_is_called_on_meta_and_layers_are_seeded_alone():
    source = ModelSource("tests.sample_models:recorded_mlp", seed=3, dtype=torch.float64)
    assert source.count == 8 and all(t.is_meta for t in source.factory.items[1].parameters())
    a, b = source.layer(2), ModelSource("tests.sample_models:recorded_mlp", seed=3).layer(2)
    assert a.weight.dtype == torch.float64 and torch.equal(a.weight, b.weight.double())
    assert not torch.equal(a.weight, source.layer(3).weight)  # seeded by index too, not one stream
    # nn.Linear's own initialisation: uniform within 1/sqrt(fan_in)
    assert a.weight.abs().max() <= 16 ** -0.5 and a.weight.std() > 0.1


@pytest.mark.parametrize("factory, message", [
    ("unresettable", "layer 1 cannot be built lazily: Unresettable holds parameters or buffers but has no "
                     "reset_parameters()"),
    ("meta_hostile", "on the meta device, so it cannot be built lazily"),
])
def test_a_factory_that_cannot_be_built_lazily_is_one_line(tmp_path, factory, message, capsys):
    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSource(f"tests.sample_models:{factory}", seed=0)
    status, err = train_refusal(capsys, "--model", f"tests.sample_models:{factory}", "--metrics-out",
                                str(tmp_path / "m.jsonl"))
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.slow
def test_no_process_materialises_a_layer_it_does_not_hold(tmp_path, monkeypatch):
    """Each worker materialises its stage and its replica (eager: stage n + 1 mod P),
    the launcher none, and the losses are the single-process run's."""
    from tests.training import bamboo_train

    args = ["--model", "tests.sample_models:recorded_mlp", "--dtype", "float64", "--iterations", "2",
            "--microbatches", "4", "--seed", "5"]
    monkeypatch.setenv("BAMBOO_RECORD", str(tmp_path / "single.txt"))
    _, reference = bamboo_train(tmp_path / "single.jsonl", *args, "--stages", "1", "--pipelines", "1")
    assert sorted(int(line.split("\t")[1]) for line in open(tmp_path / "single.txt")) == [1, 2, 3, 4, 5, 6]
    monkeypatch.setenv("BAMBOO_RECORD", str(tmp_path / "pipeline.txt"))
    _, got = bamboo_train(tmp_path / "pipeline.jsonl", *args, "--stages", "4")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=1e-9)
    stages = partition(ModelSource("tests.sample_models:recorded_mlp", seed=5).costs(), 4)
    built: dict[int, list[int]] = {}
    for line in open(tmp_path / "pipeline.txt"):
        argv, tag = line.rstrip("\n").split("\t")
        assert "bamboo/runtime/worker.py" in argv, argv  # never the launcher
        node = int(argv.split("--node ")[1].split()[0])
        built.setdefault(node, []).append(int(tag))
    for node in range(4):
        held = [*stages[node], *stages[(node + 1) % 4]]
        assert sorted(built.get(node, [])) == sorted(i for i in held if 1 <= i <= 6), node


def test_a_lazily_built_layer_keeps_shared_weights_placed_buffers_and_torchs_own_initialisers():
    source = ModelSource("tests.sample_models:shared_and_attention", seed=1)
    pair, attention = source.layer(1), source.layer(2)
    assert pair.a.weight is pair.b.weight and sum(p.numel() for p in pair.parameters()) == 16 * 16 + 2 * 16
    assert torch.equal(pair.scale, torch.full((16,), 0.5))  # placed on the CPU by the factory: kept
    weights = attention.self_attn.in_proj_weight  # nn.MultiheadAttention's _reset_parameters: xavier
    assert torch.isfinite(weights).all() and 0.05 < weights.std() < 0.5
    assert torch.equal(attention.self_attn.in_proj_bias, torch.zeros(48))
