"""--plan's network bytes per iteration against the bytes a real local job's
workers sent (their own count of every payload, summed over the run's nodes):
activations, input gradients, replica syncs and the data-parallel reduces.

Two pipelines of two stages, eager: every kind crosses the network. A ring
all-reduce sends 2(D - 1)/D times each member's gradients; the runtime counts
what each member put in, the plan what the ring sends, so the one is turned
into the other."""
import json

import pytest

from bamboo.model.activations import layer_bytes
from bamboo.model.api import ModelSource
from commands.train import cli
from commands.train.flags import build_parser
from commands.train.plan import make_plan
from tests.training import bamboo_train

ITERATIONS = 3
FLAGS = ["--model", "hf:llama-tiny", "--seq", "64", "--batch", "2", "--microbatches", "4", "--stages", "2",
         "--local-nodes", "4", "--zones", "a,b"]


@pytest.mark.slow  # eight processes starting (about 25 s): make test-slow
def test_the_planned_bytes_per_iteration_are_those_the_workers_sent(tmp_path):
    metrics = tmp_path / "m.jsonl"
    bamboo_train(metrics, *FLAGS, "--iterations", str(ITERATIONS), timeout=300)
    summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
    sent = {}
    for by_kind in summary["sent_bytes"].values():
        for kind, count in by_kind.items():
            sent[kind] = sent.get(kind, 0) + count / ITERATIONS
    cfg = cli.config_from_args(build_parser().parse_args(FLAGS))
    source = ModelSource.of(cfg.model)
    links = make_plan(cfg, source.costs(), layer_bytes(source), (4, 64)).links
    pipelines = 2
    measured = {"activations, forward": sent["send_act"], "input gradients, back": sent["send_grad"],
                "replica syncs": sent["send_sync"],
                "data-parallel reduce": sent["reduce"] * 2 * (pipelines - 1) / pipelines}
    assert set(measured) == set(links)
    print("link planned_bytes sent_bytes planned/sent (per iteration; flags: " + " ".join(FLAGS) + ")")
    for name, planned in links.items():
        print(f"{name:24} {planned:12.0f} {measured[name]:12.0f} {planned / measured[name]:8.3f}")
    for name, planned in links.items():
        assert abs(planned - measured[name]) <= 0.10 * measured[name], (name, planned, measured[name])
