"""bamboo-launch --estimate: dollars per billion tokens for every strategy and
placement, from the instance table's prices; nothing launched, nothing read."""
import json

import pytest

from cloud import launch
from sim.estimate import ONE_ZONE, SPREAD
from sim.simulator import STRATEGIES

EC2 = ["ec2", "--nodes", "4", "--zones", "a,b", "--region", "us-east-1", "--image", "ami-1", "--etcd", "auto",
       "--job", "j1", "--bucket", "b", "--endpoint-url", "http://127.0.0.1:9"]  # nothing listens
JOB = ["--model", "hf:llama-tiny", "--seq", "64", "--batch", "2", "--stages", "2", "--microbatches", "4",
       "--checkpoint", "s3://b/ck", "--checkpoint-keep", "2"]
QUICK = ["--estimate", "--estimate-hours", "2"]


def run(capsys, tmp_path, *argv):
    code = launch.main(["--state", str(tmp_path / "state.json"), *argv])
    out = capsys.readouterr()
    assert not (tmp_path / "state.json").exists()  # nothing launched, nothing recorded
    return code, out.out, out.err


def _estimate(capsys, tmp_path, *extra) -> dict:
    code, out, err = run(capsys, tmp_path, *EC2, "--instance-type", "g5.xlarge", *QUICK, *JOB, *extra)
    assert code == 0, err
    return json.loads(out.splitlines()[-1])


def test_every_strategy_in_both_placements_and_on_demand_in_one_zone(capsys, tmp_path):
    code, out, err = run(capsys, tmp_path, *EC2, "--instance-type", "g5.xlarge", *QUICK, *JOB)
    assert code == 0, err
    found = json.loads(out.splitlines()[-1])
    assert set(found["estimate"][SPREAD]) == set(STRATEGIES) - {"on-demand"}
    assert set(found["estimate"][ONE_ZONE]) == set(STRATEGIES)
    assert found["instance"]["spot"] == 0.45 and found["instance"]["on_demand"] == 1.006
    # the checkpoints kept: two of weights and two AdamW moments in fp32
    assert found["charges"]["stored_gib"] == pytest.approx(2 * 3 * 4 * found["job"]["parameters"] / 2 ** 30)
    assert found["charges"]["etcd_per_hour"] == 0.0208
    for strategy in STRATEGIES:
        assert f"  {strategy}" in out
    assert "cheapest: " in out and "spread over a, b" in out and "all in a" in out
    one = found["estimate"][ONE_ZONE]
    assert all(row["dollars_per_hour"]["network"] == 0 for row in one.values())


def test_the_spot_price_from_a_prices_file_scales_the_nodes_bill(capsys, tmp_path):
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"g5.xlarge": {"spot": 0.9}}))
    base = _estimate(capsys, tmp_path)["estimate"][SPREAD]["bamboo"]["dollars_per_hour"]
    doubled = _estimate(capsys, tmp_path, "--prices", str(table))["estimate"][SPREAD]["bamboo"]["dollars_per_hour"]
    assert doubled["nodes"] == pytest.approx(2 * base["nodes"], rel=1e-3)
    assert doubled["boot"] == pytest.approx(2 * base["boot"], rel=1e-3)
    assert doubled["network"] == base["network"]


def test_the_cross_zone_bytes_are_the_plans_links_by_the_zones_they_cross(capsys, tmp_path):
    """4 nodes in zones a, b, a, b at P=2: each pipeline's two stages in different
    zones (the placement's rule), so activations, gradients and syncs all cross,
    and the reduce crosses where the nodes of one stage differ in zone."""
    found = _estimate(capsys, tmp_path)
    links = found["job"]["network_bytes_per_iteration"]
    crossing = found["estimate"][SPREAD]["bamboo"]["cross_zone_bytes_per_iteration"]
    # the placement deals a, b, a, b as (a b) (a b): each stage's two nodes share a zone, so no reduce crosses
    assert crossing == links["activations, forward"] + links["input gradients, back"] + links["replica syncs"]
    assert found["estimate"][SPREAD]["redo"]["cross_zone_bytes_per_iteration"] == crossing - links["replica syncs"]


@pytest.mark.parametrize("argv,says", [
    (EC2 + JOB + ["--preemption-rate", "0.5"], "--preemption-rate goes with --estimate"),
    (EC2 + JOB + ["--estimate", "--plan"], "--plan and --estimate each print and exit"),
    (EC2 + JOB + ["--estimate", "--zone-bursts", "2"], "--zone-bursts must be a share"),
    (EC2 + JOB + ["--estimate", "--instance-type", "x9.huge"], "no price for x9.huge"),
    (EC2 + JOB + ["--estimate", "--boot-minutes", "-1"], "--boot-minutes must be from 0"),
    (EC2 + JOB + ["--estimate", "--instance-type", "g5.12xlarge"], "g5.12xlarge has 4 GPUs"),
    (EC2 + JOB + ["--estimate", "--preemption-rate", "100", "--estimate-hours", "8000"], "more than 200000"),
    ([*EC2[:4], "a,a", *EC2[5:], *JOB, "--estimate"], "a zone named twice"),
    (["gcp", "--project", "p", "--nodes", "4", "--zones", "a", "--region", "r", "--image", "i", "--etcd", "auto",
      "--job", "j", "--bucket", "b", "--machine-type", "n1-standard-4", "--accelerator", "nvidia-tesla-a100:1",
      *JOB, "--estimate"], "no price for n1-standard-4 with nvidia-tesla-a100:1"),
])
def test_bad_estimates_are_refused_in_one_line(capsys, tmp_path, argv, says):
    code, _, err = run(capsys, tmp_path, *argv)
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_gcp_types_with_their_own_gpus_are_priced_without_flags(capsys, tmp_path):
    gcp = ["gcp", "--project", "p", "--nodes", "4", "--zones", "us-central1-a", "--region", "us-central1",
           "--image", "i", "--etcd", "auto", "--job", "j", "--bucket", "b", "--machine-type", "g2-standard-8"]
    code, out, err = run(capsys, tmp_path, *gcp, *QUICK, *JOB)
    assert code == 0, err
    found = json.loads(out.splitlines()[-1])
    assert found["instance"]["gpu"] == "L4" and set(found["estimate"]) == {ONE_ZONE}
    assert found["charges"]["cross_zone_per_gib"] == 0.01


def test_the_dashboard_prices_a_node_as_one_gpu_of_its_instance():
    """A node is one GPU's worker: a 4-GPU instance's price is shared by its four."""
    from cloud.watch import prices
    assert prices({"instance_types": ["p3.8xlarge"]}) == (round(3.67 / 4, 4), round(12.24 / 4, 4))
    assert prices({"instance_types": ["g5.xlarge", "g4dn.xlarge"]}) == (round((0.45 + 0.22) / 2, 4),
                                                                         round((1.006 + 0.526) / 2, 4))
    assert prices({"priced_as": "n1-standard-4 with nvidia-tesla-a100:1"}) == (None, None)
