"""bamboo-launch --estimate's bytes between zones against those a real local job's
workers sent (their own count of every payload) from nodes in two zones.

Four nodes, zones a, b, a, b (node n in zone n mod 2, as the local cluster and
the estimate both deal them), two pipelines of two stages, eager. Which stage a
node ran is read from what it sent: a first stage sends activations and no input
gradients, a last stage the reverse. Where each stage's nodes share a zone, the
other stage's in the other zone, every activation, input gradient and replica sync
crosses a zone and the reduces (between the nodes of one stage) do not."""
import json

import pytest

from cloud import launch
from sim.estimate import SPREAD
from tests.training import bamboo_train

ITERATIONS = 3
MODEL = ["--model", "hf:llama-tiny", "--seq", "64", "--batch", "2", "--microbatches", "4", "--stages", "2"]


def measured_cross_zone_bytes(sent: dict[str, dict]) -> float:
    """Bytes per iteration that left their zone, from each node's counts."""
    zone = {node: "ab"[int(node) % 2] for node in sent}
    first = {n for n, kinds in sent.items() if kinds.get("send_act", 0) and not kinds.get("send_grad", 0)}
    last = {n for n, kinds in sent.items() if kinds.get("send_grad", 0) and not kinds.get("send_act", 0)}
    assert len(first) == len(last) == 2 and first | last == set(sent), sent
    assert len({zone[n] for n in first}) == len({zone[n] for n in last}) == 1, (first, last)
    assert {zone[n] for n in first} != {zone[n] for n in last}
    kinds = ("send_act", "send_grad", "send_sync")
    return sum(counts.get(k, 0) for counts in sent.values() for k in kinds) / ITERATIONS


@pytest.mark.slow  # eight processes starting (about 25 s): make test-slow
def test_the_estimated_bytes_between_zones_are_those_the_workers_sent(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    bamboo_train(metrics, *MODEL, "--local-nodes", "4", "--zones", "a,b", "--iterations", str(ITERATIONS),
                 timeout=300)
    sent = json.loads(metrics.read_text().splitlines()[-1])["summary"]["sent_bytes"]
    measured = measured_cross_zone_bytes(sent)
    code = launch.main(["--state", str(tmp_path / "s.json"), "ec2", "--nodes", "4", "--zones", "a,b",
                        "--region", "us-east-1", "--image", "ami-1", "--etcd", "auto", "--job", "j", "--bucket", "b",
                        "--instance-type", "g5.xlarge", "--estimate", "--estimate-hours", "1", *MODEL])
    found = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 0
    estimated = found["estimate"][SPREAD]["bamboo"]["cross_zone_bytes_per_iteration"]
    print(f"bytes between zones per iteration: estimated {estimated:.0f}, sent {measured:.0f}, "
          f"ratio {estimated / measured:.3f} (flags: {' '.join(MODEL)}, 4 nodes in zones a,b)")
    assert abs(estimated - measured) <= 0.10 * measured
