"""bamboo-launch configures the job: bamboo-train's arguments are checked by its
own code before any request, the job's config is in its etcd before any node
boots (bamboo-status shows it), the wheel is in S3, and bad input or a launch
failing half-way leaves nothing behind. Real boto3 against moto, a real etcd."""
import base64
import json
import os
import subprocess
import sys

import boto3
import pytest

from bamboo.control.protocol import CONFIG, job_root
from cloud.launch import main as launch_main

REGION = "us-east-1"
ZONES = "us-east-1a,us-east-1b,us-east-1c"
BIN = os.path.dirname(sys.executable)


@pytest.fixture
def aws(moto_endpoint, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(k, v)
    clients = {s: boto3.client(s, region_name=REGION, endpoint_url=moto_endpoint)
               for s in ("ec2", "s3", "autoscaling")}
    image = clients["ec2"].describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return moto_endpoint, clients, image


def run(command, *args):
    return subprocess.run([os.path.join(BIN, command), *args], capture_output=True, text=True, timeout=120)


def launch_refusal(capsys, *args) -> tuple[int, str]:
    """bamboo-launch's main in this process, for input it refuses before any request
    (a process each would import torch again): its exit status and stderr. The
    other tests run the command itself."""
    try:
        status = launch_main(list(args))
    except SystemExit as e:  # argparse's refusals
        status = e.code
    return status, capsys.readouterr().err


def launch_args(endpoint, image, etcd, job, name, *extra):
    return ["--state", extra[0], "ec2", "--nodes", "3", "--zones", ZONES, "--region", REGION, "--image", image,
            "--etcd", etcd, "--job", job, "--name", name, "--endpoint-url", endpoint, *extra[1:]]


TRAIN = ["--model", "tiny", "--stages", "3", "--microbatches", "6", "--iterations", "5", "--lr", "3e-4"]


def names(clients):
    templates = {t["LaunchTemplateName"] for t in clients["ec2"].describe_launch_templates()["LaunchTemplates"]}
    groups = {g["AutoScalingGroupName"] for g in clients["autoscaling"].describe_auto_scaling_groups()
              ["AutoScalingGroups"]}
    return templates, groups


def objects(clients, bucket):
    return [o["Key"] for o in clients["s3"].list_objects_v2(Bucket=bucket).get("Contents", [])]


@pytest.mark.slow  # make test-slow: a whole launch, status and down (the dry run and the undo stay in make test)
def test_launch_configures_the_job_status_shows_it_and_down_removes_it(aws, etcd, tmp_path):
    endpoint, clients, image = aws
    clients["s3"].create_bucket(Bucket="wheels-1")
    state = str(tmp_path / "state.json")
    up = run("bamboo-launch", *launch_args(endpoint, image, etcd.endpoint, "gpt-a", "bamboo-a", state,
                                           "--bucket", "wheels-1/runs", *TRAIN))
    assert up.returncode == 0, up.stderr
    status = json.loads(run("bamboo-status", "--etcd", etcd.endpoint, "--job", "gpt-a", "--json").stdout)
    assert (status["model"], status["stages"], status["iterations"], status["state"]) == ("tiny", 3, 5, "configured")
    assert status["last_iteration"] is None and status["assignment"] == []
    wheel = objects(clients, "wheels-1")
    assert len(wheel) == 1 and wheel[0].startswith("runs/bamboo-launch/gpt-a/bamboo_spot-")
    group = clients["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=["bamboo-a"])[
        "AutoScalingGroups"][0]
    policy = group["MixedInstancesPolicy"]
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == "capacity-optimized"
    assert policy["InstancesDistribution"]["OnDemandPercentageAboveBaseCapacity"] == 0
    assert len(policy["LaunchTemplate"]["Overrides"]) >= 3 and len(group["VPCZoneIdentifier"].split(",")) == 3
    shown = json.loads(run("bamboo-launch", "--state", state, "status").stdout)
    assert shown["progress"]["model"] == "tiny" and len(shown["instances"]) == 3

    assert run("bamboo-launch", "--state", state, "down").returncode == 0
    assert "bamboo-a" not in names(clients)[0] | names(clients)[1] and not objects(clients, "wheels-1")
    gone = json.loads(run("bamboo-status", "--etcd", etcd.endpoint, "--job", "gpt-a", "--json").stdout)
    assert gone["state"] == "unknown" and not os.path.exists(state)


@pytest.mark.parametrize("extra, why", [
    (["--stages", "0"], "--stages must be at least 1"),
    (["--stages", "99"], "more than model tiny's"),
    (["--data", "/tmp/local.txt"], "cannot read this machine's files"),
    (["--metrics-out", "m.jsonl"], "--metrics-out is not for a cloud job"),
    (["--metrics-o", "m.jsonl"], "--metrics-out is not for a cloud job"),  # argparse's abbreviation
    (["--log-dir", "logs"], "--log-dir is not for a cloud job"),
    (["--package", "bamboo"], "unrelated project"),
    (["--package", "bamboo-spot"], "bare name"),
    (["--replica-sync", "next"], "--replica-sync next with agents needs --checkpoint"),  # a cloud job's nodes run them
    (["--name", "ab"], "--name 'ab' is not a ec2 resource name: 3 to 128"),
    (["--name", "x y z"], "is not a ec2 resource name"),
    (["--region", " "], "--region must not be empty"),
    (["--image", ""], "--image must not be empty"),
])
def test_bad_input_is_refused_before_any_request(extra, why, tmp_path, capsys):
    """The endpoints are unreachable: any request would fail with another message."""
    args = launch_args("http://127.0.0.1:9", "ami-1", "127.0.0.1:9", "j", "bamboo-n", str(tmp_path / "s.json"),
                       "--bucket", "b", "--model", "tiny", *extra)
    status, err = launch_refusal(capsys, *args)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and why in lines[0], lines
    assert not os.listdir(tmp_path)


def test_a_job_name_outside_the_one_rule_is_refused_before_any_request(tmp_path, capsys):
    """A job's name prefixes its etcd keys and names its bucket prefix and labels: `/`
    would reach into another job's keys, capitals break cloud labels. The command
    itself for one, its main in this process for the other."""
    def args(job):
        return launch_args("http://127.0.0.1:9", "ami-1", "127.0.0.1:9", job, "bamboo-n", str(tmp_path / "s.json"),
                           "--bucket", "b", "--model", "tiny")
    out = run("bamboo-launch", *args("team/a"))
    status, err = launch_refusal(capsys, *args("Gpt"))
    for job, (code, said) in {"team/a": (out.returncode, out.stderr), "Gpt": (status, err)}.items():
        lines = said.strip().splitlines()
        assert code == 2 and len(lines) == 1 and f"--job {job!r}: a job name is" in lines[0], said


@pytest.mark.parametrize("record, why", [
    (None, "is not a launch record (IsADirectoryError)"),
    ("[]", "no provider ec2 or gcp in it"),
    ('{"provider": "azure"}', "no provider ec2 or gcp in it"),
    ('{"provider": "gcp", "region": "r", "job": "j", "etcd": "e:1", "wheel": "w"}', "(no project)"),
    ("{", "is not a launch record (JSONDecodeError)"),
])
def test_a_launch_record_that_is_not_one_is_one_line(record, why, tmp_path, capsys):
    state = tmp_path / "state.json"
    if record is None:
        state.mkdir()
    else:
        state.write_text(record)
    status, err = launch_refusal(capsys, "status", "--state", str(state))
    lines = err.strip().splitlines()
    assert status != 0 and len(lines) == 1 and why in lines[0], err


def test_object_storage_data_and_checkpoints_are_checked_not_downloaded(gcs, s3):
    """The launch checks each object exists (metadata, a listing), the nodes fetch it."""
    from cloud.common import BadInput
    from cloud.job import job_config
    gcs.put("data", "tokens.bin", bytes(4000))
    s3.create_bucket(Bucket="ckpts")
    s3.put_object(Bucket="ckpts", Key="val.bin", Body=bytes(400))
    cfg = job_config([*TRAIN, "--data", "gs://data/tokens.bin", "--val-data", "s3://ckpts/val.bin",
                      "--checkpoint", "gs://ckpts/run"], 3, "j")
    assert cfg.data.data_files == ("gs://data/tokens.bin",) and cfg.checkpoints.checkpoint == "gs://ckpts/run"
    assert ("GET", "media") not in gcs.requests and ("GET", "metadata") in gcs.requests
    assert job_config([*TRAIN, "--checkpoint", "s3://ckpts/run"], 3, "j").checkpoints.checkpoint == "s3://ckpts/run"
    for extra, why in ((["--data", "gs://data/gone.bin"], "gs://data/gone.bin: no such object"),
                       (["--checkpoint", "gs://nope/ck"], "gs://nope/ck/: cannot list it: no such bucket"),
                       (["--checkpoint", "/tmp/ck"], "give s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")):
        with pytest.raises(BadInput, match=why):
            job_config([*TRAIN, *extra], 3, "j")


def test_a_prefix_holding_another_job_s_checkpoints_is_refused_and_none_is_warned_of(s3):
    """The commit records name their job: a prefix of the job's own checkpoints is
    taken; another job's, or one whose records name none, is refused before any request."""
    import json as json_
    from cloud.common import BadInput
    from cloud.job import check_checkpoints, job_config
    s3.create_bucket(Bucket="ckpts")
    for key, job in (("mine/ckpt-00000004-run-e000001/commit.json", "j"),
                     ("theirs/ckpt-00000008-run-e000003/commit.json", "other"),
                     ("old/ckpt-00000002-run-e000000/commit.json", None)):
        record = {"layers": {"0": "ab"}, **({"job": job} if job else {})}
        s3.put_object(Bucket="ckpts", Key=key, Body=json_.dumps(record).encode())
    assert check_checkpoints(job_config([*TRAIN, "--checkpoint", "s3://ckpts/mine"], 3, "j")) == []
    for prefix, owner in (("theirs", "job 'other'"), ("old", "a job that named none")):
        with pytest.raises(BadInput, match=f"s3://ckpts/{prefix}: holds checkpoints of {owner} "
                                           f"\\(ckpt-0000000.-run-e00000.\\): give job 'j' a prefix of its own"):
            check_checkpoints(job_config([*TRAIN, "--checkpoint", f"s3://ckpts/{prefix}"], 3, "j"))
    (warning,) = check_checkpoints(job_config(TRAIN, 3, "j"))
    assert warning.startswith("no --checkpoint: a burst that takes a stage from every node ends the job")


def test_a_relaunch_into_the_jobs_own_checkpoints_resumes_from_the_newest(s3):
    """The config the nodes get resumes, from the newest complete checkpoint (the
    agents find it the same way: agents/membership.py); an empty prefix starts afresh."""
    import json as json_
    from cloud.job import continued, job_config
    s3.create_bucket(Bucket="ckpts")
    layers = job_config(TRAIN, 3, "j").model.layers
    record = json_.dumps({"layers": {str(i): "ab" for i in range(layers)}, "job": "j"}).encode()
    for folder, files in (("ckpt-00000004-run-e000001", layers), ("ckpt-00000008-run-e000002", layers),
                          ("ckpt-00000010-run-e000003", layers - 1),  # committed, a layer file gone since
                          ("ckpt-00000012-run-e000004", None)):       # never committed
        for i in range(files if files is not None else layers):
            s3.put_object(Bucket="ckpts", Key=f"mine/{folder}/layer{i}.pt", Body=b"x")
        if files is not None:
            s3.put_object(Bucket="ckpts", Key=f"mine/{folder}/commit.json", Body=record)
    cfg, note = continued(job_config([*TRAIN, "--checkpoint", "s3://ckpts/mine"], 3, "j"))
    assert cfg.checkpoints.resume and note.endswith("in s3://ckpts/mine, taken before iteration 8")
    cfg, note = continued(job_config([*TRAIN, "--checkpoint", "s3://ckpts/empty"], 3, "j"))
    assert not cfg.checkpoints.resume and note is None


@pytest.mark.slow  # make test stays under 15 min on a 2-core machine
def test_unreachable_etcd_unwritable_bucket_unknown_type_leave_nothing(aws, etcd, tmp_path):
    endpoint, clients, image = aws
    state = str(tmp_path / "s.json")
    cases = [("127.0.0.1:9", ["--bucket", "wheels-x"], "etcd at 127.0.0.1:9 is unreachable"),
             (etcd.endpoint, ["--bucket", "no-such-bucket"], "NoSuchBucket"),
             (etcd.endpoint, ["--bucket", "wheels-x", "--instance-type", "g9.mega"], "g9.mega not offered")]
    clients["s3"].create_bucket(Bucket="wheels-x")
    for where, extra, why in cases:
        out = run("bamboo-launch", *launch_args(endpoint, image, where, "bad", "bamboo-bad", state, *extra, *TRAIN))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1 and why in lines[0], out.stderr
        assert "bamboo-bad" not in names(clients)[0] and not objects(clients, "wheels-x")
        status = json.loads(run("bamboo-status", "--etcd", etcd.endpoint, "--job", "bad", "--json").stdout)
        assert status["state"] == "unknown" and not os.path.exists(state)


def test_a_launch_failing_half_way_removes_the_etcd_instance_and_the_wheel(aws, tmp_path):
    """The template's name is taken (a real refusal from the API) after the etcd
    instance was started, and the wheel and the etcd certificates uploaded; the
    template that was there stays, the certificates and the wheel go."""
    endpoint, clients, image = aws
    clients["s3"].create_bucket(Bucket="wheels-h")
    clients["ec2"].create_launch_template(LaunchTemplateName="bamboo-taken", LaunchTemplateData={"ImageId": image})
    boto3.client("iam", region_name=REGION, endpoint_url=endpoint).create_instance_profile(
        InstanceProfileName="bamboo-half")
    out = run("bamboo-launch", *launch_args(endpoint, image, "auto", "half", "bamboo-taken", str(tmp_path / "s.json"),
                                            "--bucket", "wheels-h", "--iam-profile", "bamboo-half", *TRAIN))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "AlreadyExists" in lines[0], out.stderr
    tagged = clients["ec2"].describe_instances(Filters=[{"Name": "tag:bamboo-job", "Values": ["half"]}])
    etcd_nodes = [i for r in tagged["Reservations"] for i in r["Instances"]]
    assert len(etcd_nodes) == 1 and etcd_nodes[0]["State"]["Name"] in ("shutting-down", "terminated")
    script = base64.b64decode(clients["ec2"].describe_instance_attribute(
        InstanceId=etcd_nodes[0]["InstanceId"], Attribute="userData")["UserData"]["Value"]).decode()
    assert 'put /bamboo/half/config < "$ROOT/var/lib/bamboo-config.json"' in script
    assert "CERTS=s3://wheels-h/bamboo-launch/half/etcd-tls/etcd-0/" in script
    templates, groups = names(clients)
    assert "bamboo-taken" in templates and "bamboo-taken" not in groups and not objects(clients, "wheels-h")
    assert not (tmp_path / "s-etcd-tls").exists()  # the operator's copy of the client certificate went too


def test_dry_run_prints_the_upload_and_the_etcd_write(tmp_path):
    out = run("bamboo-launch", *launch_args("http://127.0.0.1:9", "ami-1", "10.0.0.5:2379", "dry", "bamboo-dry",
                                            str(tmp_path / "s.json"), "--bucket", "wheels", "--dry-run", *TRAIN))
    assert out.returncode == 0, out.stderr
    requests = [json.loads(line) for line in out.stdout.splitlines()]
    ops = [r["operation"] for r in requests]
    assert ops == ["describe_availability_zones", "describe_subnets", "describe_instance_type_offerings",
                   "put_object", "generate_presigned_url", "create_security_group",
                   "authorize_security_group_ingress", "put_if_not_exists", "create_launch_template",
                   "create_auto_scaling_group"]
    write = requests[7]
    assert write["key"] == job_root("dry") + CONFIG().path
    assert write["value"]["schedule"]["stages"] == 3 and write["value"]["cluster"]["elastic"]
    assert requests[3]["params"]["Body"].endswith("bytes>") and not os.listdir(tmp_path)


@pytest.mark.slow
def test_without_bucket_or_package_the_launch_makes_its_own_bucket_and_down_removes_it(aws, etcd, tmp_path):
    """The issue's contract command names no --bucket: the wheel goes to a bucket
    named after the job and region, made by the launch and removed by down."""
    endpoint, clients, image = aws
    state = str(tmp_path / "state.json")
    up = run("bamboo-launch", *launch_args(endpoint, image, etcd.endpoint, "gpt-own", "bamboo-own", state, *TRAIN))
    assert up.returncode == 0, up.stderr
    buckets = {b["Name"] for b in clients["s3"].list_buckets()["Buckets"]}
    own = next(b for b in buckets if b.startswith("bamboo-gpt-own-"))
    assert objects(clients, own)[0].startswith("bamboo-launch/gpt-own/bamboo_spot-")
    assert run("bamboo-launch", "--state", state, "down").returncode == 0
    assert own not in {b["Name"] for b in clients["s3"].list_buckets()["Buckets"]}
