"""The launch records: one per job in one file, never overwritten by a second
launch; status, scale and down pick a job by name; an older one-record file reads
as its job; a file that is no record is one line."""
import json

import pytest

from cloud.common import BadInput, LaunchError
from cloud.launch import build_parser, parse
from cloud.records import check_unrecorded, pick, read_records, write_records


def record(job: str, provider: str = "ec2") -> dict:
    extra = {"project": "p"} if provider == "gcp" else {}
    return {"provider": provider, "region": "r", "job": job, "etcd": "e:2379", "wheel": None, **extra}


def test_two_jobs_keep_their_records_and_down_leaves_the_other_s(tmp_path):
    path = str(tmp_path / "launch.json")
    write_records(path, {"a": record("a")})
    check_unrecorded(path, "b")
    write_records(path, {**read_records(path), "b": record("b", "gcp")})
    with pytest.raises(BadInput, match="job 'a' is recorded in .* already: bamboo-launch down a first"):
        check_unrecorded(path, "a")
    records = read_records(path)
    assert pick(records, "b", path) == record("b", "gcp")
    with pytest.raises(LaunchError, match="records jobs a, b: name one"):
        pick(records, None, path)
    with pytest.raises(LaunchError, match="no job 'c' recorded in .* \\(it records a, b\\)"):
        pick(records, "c", path)
    write_records(path, {j: r for j, r in records.items() if j != "a"})
    assert pick(read_records(path), None, path) == record("b", "gcp")
    write_records(path, {})
    assert not (tmp_path / "launch.json").exists() and read_records(path) == {}


def test_a_record_from_before_per_job_records_is_its_job(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(record("gpt")))
    assert read_records(str(path)) == {"gpt": record("gpt")}


@pytest.mark.parametrize("text,why", [("[1]", "no provider ec2 or gcp"), ('{"jobs": {"a": {"provider": "x"}}}',
                                                                        "no provider ec2 or gcp"),
                                      ('{"jobs": {"a": {"provider": "gcp", "job": "a"}}}', "(no project, region"),
                                      ("{", "JSONDecodeError")])
def test_a_file_that_is_no_record_is_refused_by_what_is_wrong(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(LaunchError, match=why.replace("(", "\\(")):
        read_records(str(path))


@pytest.mark.parametrize("argv,job,nodes", [(["scale", "12"], None, 12), (["scale", "gpt", "12"], "gpt", 12),
                                            (["down"], None, None), (["down", "gpt"], "gpt", None),
                                            (["--state", "s.json", "status", "gpt"], "gpt", None)])
def test_the_commands_take_a_job_name_or_none(argv, job, nodes):
    args, rest = parse(build_parser(), argv)
    assert (args.job, getattr(args, "nodes", None), rest) == (job, nodes, [])


def test_a_gcp_machine_type_with_its_own_gpus_needs_no_accelerator():
    from cloud.gcp import accelerator_for, node_gpus
    assert accelerator_for("a2-highgpu-4g", None) == "none" and node_gpus("a2-highgpu-4g", "none") == 4
    assert accelerator_for("g2-standard-8", None) == "none" and node_gpus("g2-standard-8", "none") == 1
    assert accelerator_for("n1-standard-8", None) == "nvidia-tesla-t4:1" and node_gpus("n1-standard-8", "none") == 0
    assert accelerator_for("n1-standard-8", "nvidia-tesla-v100:2") == "nvidia-tesla-v100:2"
    with pytest.raises(BadInput, match="comes with 8 GPU"):
        accelerator_for("a3-highgpu-8g", "nvidia-h100-80gb:8")
