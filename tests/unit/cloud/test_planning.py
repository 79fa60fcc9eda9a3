"""bamboo-launch --plan: the plan against the group's instance types, and no request sent."""
import pytest

from cloud import launch

EC2 = ["ec2", "--nodes", "16", "--zones", "us-east-1a,us-east-1b", "--region", "us-east-1", "--image", "ami-1",
       "--etcd", "auto", "--job", "j1", "--bucket", "b", "--endpoint-url", "http://127.0.0.1:9"]  # nothing listens
GCP = ["gcp", "--project", "p", "--nodes", "16", "--zones", "us-central1-a", "--region", "us-central1",
       "--image", "img", "--etcd", "auto", "--job", "j1", "--bucket", "b", "--endpoint-url", "http://127.0.0.1:9"]
JOB = ["--model", "hf:llama-1b", "--seq", "2048", "--batch", "1", "--stages", "4", "--microbatches", "16", "--plan"]


def run(capsys, tmp_path, *argv):
    code = launch.main(["--state", str(tmp_path / "state.json"), *argv])
    out = capsys.readouterr()
    assert not (tmp_path / "state.json").exists()  # nothing launched, nothing recorded
    return code, out.out, out.err


@pytest.mark.parametrize("where,fits", [
    (EC2 + ["--instance-type", "g5.xlarge"], "fits g5.xlarge:"),
    (GCP + ["--machine-type", "g2-standard-8"], "fits g2-standard-8 (L4):"),
    (GCP + ["--machine-type", "n1-standard-8", "--accelerator", "nvidia-tesla-a100:1"],
     "fits n1-standard-8 with 1 A100"),
])
def test_a_layout_that_fits_the_groups_gpus(capsys, tmp_path, where, fits):
    code, out, err = run(capsys, tmp_path, *where, *JOB)
    assert code == 0 and fits in out and "per GPU (GiB)" in out, err


def test_the_default_ec2_types_include_a_16_gb_t4_which_it_does_not_fit(capsys, tmp_path):
    code, out, err = run(capsys, tmp_path, *EC2, *JOB)
    assert code == 2 and "the smallest of g4dn.xlarge" in err and "15.0 GiB" in err and err.count("\n") == 1


def test_an_instance_type_the_planner_does_not_know_asks_for_the_gpu_memory(capsys, tmp_path):
    code, _, err = run(capsys, tmp_path, *EC2, "--instance-type", "x9.huge", *JOB)
    assert code == 2 and "x9.huge" in err and "--gpu-memory" in err
    code, out, err = run(capsys, tmp_path, *EC2, "--instance-type", "x9.huge", *JOB, "--gpu-memory", "80")
    assert code == 0 and "fits 80 GiB GPUs" in out
