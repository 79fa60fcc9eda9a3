"""The dashboard's ledger of paid node-seconds on a real local job (agents, workers,
etcd, a SIGKILL), read from etcd alone, against the launcher's own clock of its
agents' processes, timed from outside to the moment each exits: the parts sum to
the node-seconds paid within 1%.

Eight nodes at P=3 under the default --surplus burst: two pipelines, the prior's
standby kept and the other node over released (it drains and leaves at once); a
node of a pipeline SIGKILLed in iteration 5, the standby taking its place."""
import json

import pytest

from bamboo.control.etcd import EtcdServer
from commands.status.jobview import open_job
from commands.status.runstats import summary
from tests.training import bamboo_train

ARGS = ["--model", "tiny", "--stages", "3", "--microbatches", "4", "--iterations", "14", "--local-nodes", "8",
        "--zones", "a,b,c", "--preempt", "1@5:3", "--job", "ledger"]


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
    assert len(timed["agent_seconds"]) == 8 and {"training", "standby", "start-up", "leaving"} <= set(parts), parts
    print(f"ledger {sum(parts.values()) * 3600:.1f} node-seconds, launcher {paid:.1f}; parts (hours): {parts}")
    assert abs(sum(parts.values()) * 3600 - paid) <= 0.01 * paid, (parts, timed["agent_seconds"])
    assert shown["cost"]["node_hours"] == pytest.approx(sum(parts.values()), rel=1e-9)  # the panel's total is theirs
