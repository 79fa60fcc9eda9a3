"""The dashboard's ledger on real local jobs (agents, workers, etcd), read from etcd
alone. Its paid node-seconds against the launcher's own clock of its agents'
processes, timed from outside to the moment each exits: the parts sum to the
node-seconds paid within 1% (eight nodes at P=3 keeping one standby, --surplus
fixed: two pipelines, the standby kept and the other node over released; a node
of a pipeline SIGKILLed in iteration 5, the standby taking its place). Its bytes
between zones against the workers' own counts, attributed independently
(tests/integration/test_estimate_network.py: every activation, input gradient and
replica sync crosses, no reduce does): within 10%."""
import json

import pytest

from bamboo.control.etcd import EtcdServer
from commands.status.jobview import open_job
from commands.status.runstats import summary
from tests.integration.test_estimate_network import ITERATIONS, MODEL, measured_cross_zone_bytes
from tests.training import bamboo_train

ARGS = ["--model", "tiny", "--stages", "3", "--microbatches", "4", "--iterations", "14", "--local-nodes", "8",
        "--zones", "a,b,c", "--preempt", "1@5:3", "--job", "ledger", "--surplus", "fixed", "--fixed-standby", "1",
        "--replica-sync", "end"]  # the sync at the end: its redundancy has a share to book (next's is nil here)


# eight processes, about a minute: make test-slow (tests/unit/commands/test_redundant_share.py checks the ledger's shares)
@pytest.mark.slow
def test_the_ledger_sums_to_the_node_seconds_the_launcher_timed(tmp_path):
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        out, _ = bamboo_train(metrics, *ARGS, "--etcd", etcd.endpoint)
        view = open_job(etcd.endpoint, "ledger")
        try:
            shown = summary(view.look())
        finally:
            view.cluster.close()
    timed = next(json.loads(line)["summary"] for line in metrics.read_text().splitlines() if "summary" in line)
    paid = sum(timed["agent_seconds"].values())
    parts = shown["cost"]["ledger"]
    assert "released: in no pipeline, beyond the 1 standby" in out.stderr, out.stderr[-2000:]
    assert len(timed["agent_seconds"]) == 8
    assert {"training", "redundancy", "standby", "start-up", "leaving"} <= set(parts), parts
    print(f"ledger {sum(parts.values()) * 3600:.1f} node-seconds, launcher {paid:.1f}; parts (hours): {parts}")
    assert abs(sum(parts.values()) * 3600 - paid) <= 0.01 * paid, (parts, timed["agent_seconds"])
    assert shown["cost"]["node_hours"] == pytest.approx(sum(parts.values()), rel=1e-9)  # the panel's total is theirs


@pytest.mark.slow  # eight processes starting (about 25 s): make test-slow
def test_the_ledger_s_bytes_between_zones_are_those_the_workers_sent(tmp_path):
    """Four nodes in zones a, b: two pipelines of two stages, each stage's nodes in
    one zone (test_estimate_network's layout)."""
    metrics = tmp_path / "m.jsonl"
    with EtcdServer() as etcd:
        bamboo_train(metrics, *MODEL, "--local-nodes", "4", "--zones", "a,b", "--iterations", str(ITERATIONS),
                     "--etcd", etcd.endpoint, "--job", "bytes", timeout=300)
        view = open_job(etcd.endpoint, "bytes")
        try:
            network = summary(view.look(), (None, None, 0.01))["cost"]["network"]
        finally:
            view.cluster.close()
    sent = next(json.loads(line)["summary"] for line in metrics.read_text().splitlines() if "summary" in line)
    counted = measured_cross_zone_bytes(sent["sent_bytes"]) * ITERATIONS
    print(f"bytes between zones: ledger {network['cross_zone_bytes']:.0f}, workers' counts {counted:.0f}")
    assert abs(network["cross_zone_bytes"] - counted) <= 0.10 * counted, network
    assert network["cross_zone_dollars"] == pytest.approx(network["cross_zone_bytes"] / 2 ** 30 * 0.01)
    assert network["by_kind"]["reduce"]["crossed"] == 0 < network["by_kind"]["reduce"]["sent"]
