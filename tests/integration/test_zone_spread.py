"""--zone-spread pack on real processes (agents, workers, etcd, a SIGKILL): six
nodes in zones a and b (node n in zone n mod 2), two pipelines of three stages,
each in one zone. By the workers' own counts of every payload, only the
data-parallel reduce crossed a zone: the dashboard's tally of bytes between
zones (from each epoch's pipelines) equals the reduce bytes they sent, and the
activations, gradients and replica syncs stayed in their zone. A node of one
pipeline is killed; its zone-mate takes its stage over, and every loss equals
the single-process reference's."""
import json

import pytest

from bamboo.control.etcd import EtcdServer
from commands.status.jobview import open_job
from commands.status.runstats import summary
from tests.training import bamboo_train

COMMON = ["--model", "tiny", "--microbatches", "4", "--seed", "5", "--dtype", "float64", "--iterations", "8"]
AGENTS = ["--stages", "3", "--local-nodes", "6", "--zones", "a,b", "--zone-spread", "pack", "--surplus", "keep",
          "--max-stages-per-node", "1", "--job", "packed"]


@pytest.mark.slow  # about a minute: make test-slow; tests/unit/agents/test_spread.py checks the packing
def test_packed_pipelines_keep_their_bytes_in_their_zone_and_the_reference_s_losses(tmp_path):
    _, reference = bamboo_train(tmp_path / "ref.jsonl", *COMMON, "--stages", "1")
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        out, records = bamboo_train(metrics, *COMMON, *AGENTS, "--etcd", etcd.endpoint, "--preempt", "4@3:2")
        view = open_job(etcd.endpoint, "packed")
        try:
            network = summary(view.look(), (None, None, 0.01))["cost"]["network"]
        finally:
            view.cluster.close()
    first = next(e for r in records for e in r["events"] if e["type"] == "reconfigure")
    assert sorted({n % 2 for n in p} for p in first["pipelines"]) == [{0}, {1}], first  # each pipeline in one zone
    sent = json.loads(metrics.read_text().splitlines()[-1])["summary"]["sent_bytes"]
    reduce = sum(kinds.get("reduce", 0) for kinds in sent.values())
    print(f"bytes between zones: tally {network['cross_zone_bytes']:.0f}, reduces sent {reduce}; "
          f"all sent {network['sent_bytes']:.0f}")
    assert reduce > 0 and network["cross_zone_bytes"] == pytest.approx(reduce, rel=0.10), (network, sent)
    assert network["sent_bytes"] > 2 * reduce  # the rest, in their zone: activations, gradients, syncs
    last = list({r["iteration"]: r for r in records}.values())
    assert [r["iteration"] for r in last] == list(range(8))
    for got, want in zip(last, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9), f"iteration {got['iteration']}"
