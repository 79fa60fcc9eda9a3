"""`--config FILE.toml` (commands/train/jobfile.py), checked against flags written
out by hand: a file and the same flags give the same namespace and JobConfig, the
command line wins, every flag can be written in the file, each mistake in the file
is one line and status 2, bamboo-launch takes the same file (and its [launch]
section), and the example in docs/job-file.md configures a job."""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cloud import launch
from cloud.common import BadInput
from cloud.job import job_config
from commands.train import cli, jobfile
from bamboo.control.protocol import CONFIG, job_root

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "job-file.md").read_text()

FILE = """
[model]
model = "tiny"
seq = 16
seed = 3
dtype = "float32"

[schedule]
stages = 3
microbatches = 6
iterations = 7
batch = 3
redundancy = "lazy"
auto_prior_rate = 0.1
auto-prior-hours = 1.5         # '-' as in the flag is accepted

[recipe]
lr = 3e-4
min_lr = 1e-5
lr_schedule = "cosine"
warmup = 2
weight_decay = 0.1
betas = [0.9, 0.95]
grad_clip = 1                  # an integer for a float flag
precision = "bf16"
initial_loss_scale = 1024.0
loss_scale_window = 50
min_loss_scale = 2.0

[data]
token_dtype = "uint32"
val_fraction = 0.1
eval_every = 2
eval_batches = 4

[checkpoints]
checkpoint = "{tmp}/ckpt"
checkpoint_every = 2
checkpoint_seconds = 30
save_dir = "{tmp}/layers"
export = "{tmp}/export"
metrics_out = "{tmp}/m.jsonl"
plot = "{tmp}/m.png"
tensorboard = "{tmp}/tb"
no_progress = true

[faults]
preempt = ["1@2", "4@4"]
failure_timeout = 2.5
lease_ttl = 10
hang_timeout = 100.0
straggler_factor = 4.0
straggler_slack = 2.0
stall_timeout = 900.0
check_replicas = true

[devices]
devices = "cpu"
share_gpu = true
transport = "gloo"

[cluster]
job = "file-job"
local_nodes = 6
zones = "a,b"
notice = "ec2"
metadata_url = "http://127.0.0.1:1/{{node}}"
join = ["1@2", "2@3"]
"""


def flags(tmp):
    """FILE as a command line, written out by hand."""
    return ["--model", "tiny", "--seq", "16", "--seed", "3", "--dtype", "float32",
            "--stages", "3", "--microbatches", "6", "--iterations", "7", "--batch", "3", "--redundancy", "lazy",
            "--auto-prior-rate", "0.1", "--auto-prior-hours", "1.5",
            "--lr", "3e-4", "--min-lr", "1e-5", "--lr-schedule", "cosine", "--warmup", "2", "--weight-decay", "0.1",
            "--betas", "0.9", "0.95", "--grad-clip", "1", "--precision", "bf16", "--initial-loss-scale", "1024",
            "--loss-scale-window", "50", "--min-loss-scale", "2",
            "--token-dtype", "uint32", "--val-fraction", "0.1", "--eval-every", "2", "--eval-batches", "4",
            "--checkpoint", f"{tmp}/ckpt", "--checkpoint-every", "2", "--checkpoint-seconds", "30",
            "--save-dir", f"{tmp}/layers", "--export", f"{tmp}/export", "--metrics-out", f"{tmp}/m.jsonl",
            "--plot", f"{tmp}/m.png", "--tensorboard", f"{tmp}/tb", "--no-progress",
            "--preempt", "1@2", "--preempt", "4@4", "--failure-timeout", "2.5", "--lease-ttl", "10",
            "--hang-timeout", "100", "--straggler-factor", "4", "--straggler-slack", "2", "--stall-timeout", "900",
            "--check-replicas", "--devices", "cpu", "--share-gpu", "--transport", "gloo",
            "--job", "file-job", "--local-nodes", "6", "--zones", "a,b", "--notice", "ec2",
            "--metadata-url", "http://127.0.0.1:1/{node}", "--join", "1@2", "--join", "2@3"]


def write(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def parse(argv: list[str]) -> argparse.Namespace:
    """What bamboo-train's main parses."""
    return jobfile.parse_args(cli.build_parser(), argv)


def without_config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "config"}


def unnamed(config: dict) -> dict:
    """A job config but its run's name (each run has one of its own: its checkpoints' folders)."""
    return {**config, "checkpoints": {k: v for k, v in config["checkpoints"].items() if k != "run"}}


def test_a_file_gives_what_its_flags_give(tmp_path):
    from_file = parse(["--config", write(tmp_path, FILE.format(tmp=tmp_path))])
    from_flags = cli.build_parser().parse_args(flags(tmp_path))
    assert without_config(from_file) == without_config(from_flags)
    assert from_file.preempt == ["1@2", "4@4"] and from_file.betas == [0.9, 0.95] and from_file.grad_clip == 1.0
    same = [unnamed(cli.config_from_args(a).to_dict()) for a in (from_file, from_flags)]
    assert same[0] == same[1]
    assert cli.local_cluster(from_file) == cli.local_cluster(from_flags)


def test_the_command_line_overrides_the_file(tmp_path):
    path = write(tmp_path, FILE.format(tmp=tmp_path))
    args = parse(["--stages", "2", "--config", path, "--preempt", "0@1", "--data", "x.txt", "y.txt", "--lr", "0.5"])
    assert (args.stages, args.lr, args.microbatches) == (2, 0.5, 6)
    assert args.preempt == ["0@1"] and args.join == ["1@2", "2@3"]  # a repeated flag replaces the file's list
    assert args.data == ["x.txt", "y.txt"] and args.config == path
    assert parse(["--config", path, "--join", "3@1", "--join", "1@1"]).join == ["3@1", "1@1"]
    assert parse(["--conf", path]).stages == 3  # --config abbreviated, as argparse allows every flag


def check(argv: list[str]) -> None:
    """bamboo-train's checks after the parse, as its main runs them."""
    args = parse(argv)
    cli.config_from_args(args)
    cli.local_cluster(args)


def test_file_values_get_the_flags_own_checks(tmp_path):
    """Type-correct values bamboo-train refuses later: the same message as the flag's."""
    for text, argv in (("[schedule]\nstages = 0\n", ["--stages", "0"]),
                       ("[faults]\nlease_ttl = 2.0\n", ["--lease-ttl", "2"]),
                       ("[cluster]\njoin = ['2@1']\n", ["--join", "2@1"])):
        with pytest.raises(ValueError) as from_file:
            check(["--config", write(tmp_path, text)])
        with pytest.raises(ValueError) as from_flags:
            check(argv)
        assert str(from_file.value) == str(from_flags.value)


def sample(action: argparse.Action) -> tuple[object, list[str]]:
    """A value for the flag unlike its default: as TOML, and as a command line."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return True, [flag]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
    else:
        value = {int: 7, float: 2.5}.get(action.type, "some/value")
    if isinstance(action, argparse._AppendAction):
        return [value, value], [flag, str(value), flag, str(value)]
    if action.nargs is not None:
        return [value, value], [flag, str(value), str(value)]
    return value, [flag, str(value)]


def test_every_flag_has_a_help_line_in_its_group():
    """What --help prints: each flag under a titled group, with a help text (the
    file's section is named under the group's title)."""
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    parser = cli.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.option_strings != ["-h", "--help"]]
    assert all(a.help and a.help.strip() for a in flags), [a.option_strings for a in flags if not a.help]
    printed = "".join(out.stdout.split())  # argparse wraps the lines, at hyphens too
    for flag in flags:
        assert "".join(flag.help.split()) in printed, flag.option_strings
    assert sum(f"in a --config file: [{s}]" in out.stdout for s in jobfile.sections(parser)) == 9
    groups = re.findall(r"^(\S[^\n]*):\n  in a --config file", out.stdout, re.M)
    assert groups[-1] == "testing and diagnostics", groups  # the test knobs come last
    testing = out.stdout[out.stdout.index("testing and diagnostics:"):]
    assert all(f in testing for f in ("--preempt", "--check-replicas", "--compute-ahead", "--local-prefix"))


def test_a_file_written_before_the_testing_group_still_reads_the_same(tmp_path):
    """The test knobs moved to [testing]; a file that gives them where they were
    declared before parses to the same values, and a key given in both is refused."""
    old = write(tmp_path, '[faults]\npreempt = ["1@3"]\ncheck_replicas = true\n[schedule]\ncompute_ahead = true\n'
                          '[cluster]\nlocal_prefix = "ns {node}"\n')
    new = write(tmp_path, '[testing]\npreempt = ["1@3"]\ncheck_replicas = true\ncompute_ahead = true\n'
                          'local_prefix = "ns {node}"\n', "new.toml")
    flagged = parse(["--preempt", "1@3", "--check-replicas", "--compute-ahead", "--local-prefix", "ns {node}"])
    for path in (old, new):
        got = parse(["--config", path])
        assert [getattr(got, d) for d in ("preempt", "check_replicas", "compute_ahead", "local_prefix")] == \
            [getattr(flagged, d) for d in ("preempt", "check_replicas", "compute_ahead", "local_prefix")]
    both = write(tmp_path, '[faults]\npreempt = ["1@3"]\n[testing]\npreempt = ["2@3"]\n', "both.toml")
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--config", both], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "[testing] preempt: given twice" in out.stderr, out.stderr


def test_every_flag_can_be_written_in_the_file(tmp_path):
    """Each flag's section and key lead back to it, and a value written there parses
    as the same value given as the flag. The --plan group asks for a check, not a
    job: it has no section."""
    parser = cli.build_parser()
    found = {s: keys for s, keys in jobfile.sections(parser).items()}
    everywhere = [a for keys in found.values() for a in keys.values()]
    planning = {"--plan", "--propose", "--instance-type", "--gpu-memory", "--host-memory"}
    flagged = [a for a in parser._actions if a.option_strings not in (["-h", "--help"], ["--config"])
               and not planning & set(a.option_strings)]
    assert sorted(map(id, everywhere)) == sorted(map(id, flagged)) and len(flagged) == 78
    assert sorted(found) == sorted(["model", "schedule", "recipe", "data", "checkpoints", "faults", "devices",
                                    "cluster", "testing"])
    for section, keys in found.items():
        for key, action in keys.items():
            assert f"--{key.replace('_', '-')}" in action.option_strings
            value, argv = sample(action)
            path = write(tmp_path, f"[{section}]\n{key} = {json.dumps(value)}\n")
            got = getattr(parse(["--config", path]), action.dest)
            assert got == getattr(parser.parse_args(argv), action.dest) != action.default, key


ERRORS = [
    ('[schedule]\nstages = "4"\n', "[schedule] stages: expected an integer, got '4'"),
    ("[schedule]\nstages = 4.0\n", "[schedule] stages: expected an integer, got 4.0"),
    ("[schedule]\nstages = true\n", "[schedule] stages: expected an integer, got True"),
    ("[model]\nlr = 0.1\n", "[model] lr: not a key of [model] (it belongs in [recipe])"),
    ('[model]\npreempt = ["1@3"]\n', "[model] preempt: not a key of [model] (it belongs in [testing])"),
    ("[recipe]\nlearning_rate = 0.1\n", "[recipe] learning_rate: not a key of [recipe]"),
    ("[optimizer]\nlr = 0.1\n", "unknown section [optimizer] (expected one of [model], [schedule],"),
    ("stages = 4\n", "stages: a key outside any section (it belongs in [schedule])"),
    ('[checkpoints]\nresume = "yes"\n', "[checkpoints] resume: expected true or false, got 'yes'"),
    ("[checkpoints]\nresume = 1\n", "[checkpoints] resume: expected true or false, got 1"),
    ('[faults]\npreempt = "1@2"\n', "[faults] preempt: expected an array, got '1@2'"),
    ("[faults]\npreempt = [1]\n", "[faults] preempt: expected a string, got 1"),
    ("[recipe]\nbetas = [0.9]\n", "[recipe] betas: expected an array of 2 values"),
    ('[recipe]\nbetas = [0.9, "x"]\n', "[recipe] betas: expected a number, got 'x'"),
    ('[recipe]\nlr_schedule = "exp"\n', "[recipe] lr_schedule: 'exp' is not one of 'constant'"),
    ('[schedule]\nfrc = "some"\n', "[schedule] frc: 'some' is not one of 'bubbles', 'all'"),
    ('[data]\ndata = ["a.txt", 1]\n', "[data] data: expected a string, got 1"),
    ('[model]\nmodel_config = "a"\nmodel-config = "b"\n', "[model] model-config: given twice"),
    ("[model]\nmodel = [\n", "not valid TOML"),
    ("[recipe\nlr = 1\n", "not valid TOML"),
]


@pytest.mark.parametrize("text, message", ERRORS)
def test_a_mistake_in_the_file_is_one_line_and_status_2(text, message, tmp_path, capsys):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as stop:
        parse(["--config", path, "--help"])  # before --help: nothing runs on a bad file
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("bamboo-train: error: ")
    assert path in err and message in err, err


def refusal(argv: list[str], capsys) -> str:
    """The one line a refused parse prints (status 2)."""
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_a_missing_file_or_an_old_python_is_one_line(tmp_path, capsys, monkeypatch):
    gone = str(tmp_path / "gone.toml")
    assert f"--config {gone!r}: cannot read it (No such file or directory)" in refusal(["--config", gone], capsys)
    monkeypatch.setattr(jobfile, "tomllib", None)  # Python 3.10
    path = write(tmp_path, "[schedule]\nstages = 3\n")
    assert "--config needs Python 3.11+ (tomllib)" in refusal(["--config", path], capsys)
    assert parse(["--stages", "3"]).stages == 3  # without --config nothing needs it


LAUNCH = """
[launch]
nodes = 3
zones = "us-east-1a,us-east-1b"
region = "us-east-1"
image = "ami-1"
etcd = "10.0.0.5:2379"
job = "from-file"
name = "bamboo-file"
bucket = "wheels"
endpoint_url = "http://127.0.0.1:9"
dry_run = true
instance_type = ["g5.xlarge", "g4dn.xlarge"]

[model]
model = "tiny"

[schedule]
stages = 3
microbatches = 6
iterations = 5

[recipe]
lr = 3e-4
betas = [0.9, 0.95]
"""
TRAIN = ["--model", "tiny", "--stages", "3", "--microbatches", "6", "--iterations", "5", "--lr", "3e-4",
         "--betas", "0.9", "0.95"]


def test_launch_reads_its_section_and_bamboo_train_skips_it(tmp_path):
    path = write(tmp_path, LAUNCH)
    args, train = launch.parse(launch.build_parser(), ["--state", "s.json", "ec2", "--config", path,
                                                       "--nodes", "6", "--instance-type", "g6.xlarge"])
    assert (args.command, args.nodes, args.region, args.job, args.dry_run) == ("ec2", 6, "us-east-1", "from-file", True)
    assert args.instance_type == ["g6.xlarge"] and args.state == "s.json" and args.security_group == []
    assert unnamed(job_config(train, 6, args.job).to_dict()) == unnamed(job_config(TRAIN, 6, "from-file").to_dict())
    assert job_config([*train, "--iterations", "9"], 3, "j").schedule.iterations == 9
    assert without_config(parse(["--config", path])) == without_config(cli.build_parser().parse_args(TRAIN))


def test_the_command_lines_state_file_wins_over_the_files(tmp_path):
    """--state comes before the command word, the file's [launch] after it: the
    command line still wins (status and down read the state file it names)."""
    path = write(tmp_path, LAUNCH.replace("[launch]\n", '[launch]\nstate = "file.json"\n'))
    args, _ = launch.parse(launch.build_parser(), ["--state", "cli.json", "ec2", "--config", path])
    assert args.state == "cli.json"
    args, _ = launch.parse(launch.build_parser(), ["ec2", "--config", path])
    assert args.state == "file.json"


def test_launch_refuses_in_the_file_what_a_cloud_job_cannot_use(tmp_path, capsys):
    for extra, why in (('[checkpoints]\nmetrics_out = "m.jsonl"\n', "[checkpoints] metrics_out is not for a cloud"),
                       ('[cluster]\njob = "other"\n', "[cluster] job is not for a cloud job: name the job in [launch]"),
                       ("[cluster]\nlocal_nodes = 4\n", "[cluster] local_nodes is not for a cloud job")):
        path = write(tmp_path, LAUNCH + extra)
        with pytest.raises(BadInput, match=re.escape(f"{path}: {why}")):
            job_config(["--config", path], 3, "j")
    path = write(tmp_path, LAUNCH.replace("nodes = 3", 'nodes = "3"'))
    with pytest.raises(SystemExit) as stop:
        launch.parse(launch.build_parser(), ["ec2", "--config", path])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.strip() == f"bamboo-launch: error: {path}: [launch] nodes: expected an " \
                                                   "integer, got '3'"


def test_launch_dry_run_from_a_file_writes_the_flags_config(tmp_path):
    path = write(tmp_path, LAUNCH)
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "bamboo-launch"), "--state",
                          str(tmp_path / "s.json"), "ec2", "--config", path], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    requests = [json.loads(line) for line in out.stdout.splitlines()]
    write_config = next(r for r in requests if r["operation"] == "put_if_not_exists")
    expected = json.loads(json.dumps(job_config(TRAIN, 3, "from-file").to_dict(), default=str))
    assert write_config["key"] == job_root("from-file") + CONFIG().path
    assert unnamed(write_config["value"]) == unnamed(expected)
    offers = next(r for r in requests if r["operation"] == "describe_instance_type_offerings")
    assert offers["params"]["Filters"][1]["Values"] == ["g5.xlarge", "g4dn.xlarge"]


def test_the_docs_table_is_the_parser_s_sections():
    rows = dict(re.findall(r"^\| `\[(\w+)\]` \| (.*) \|$", DOC, re.M))
    train = {s: list(keys) for s, keys in jobfile.sections(cli.build_parser()).items()}
    assert {s: re.findall(r"`(\w+)`", rows[s]) for s in train} == train
    sub = argparse.ArgumentParser().add_subparsers()
    clouds = {cloud: jobfile.sections(launch._cloud_parser(sub, cloud))["launch"] for cloud in launch.CLOUDS}
    assert set(re.findall(r"`(\w+)`", rows["launch"])) - {"ec2", "gcp"} == set(clouds["ec2"]) | set(clouds["gcp"])


def test_the_docs_example_configures_a_llama_job(s3, tmp_path):
    """The example as written: its objects exist (moto's S3), the launch's options
    come from [launch], and bamboo-train's checks pass."""
    example = re.search(r"```toml\n(.*?)```", DOC, re.S).group(1)
    s3.create_bucket(Bucket="my-bamboo")
    s3.put_object(Bucket="my-bamboo", Key="data/train.bin", Body=bytes(4000))
    s3.put_object(Bucket="my-bamboo", Key="data/val.bin", Body=bytes(400))
    path = write(tmp_path, example, "llama-spot.toml")
    args, train = launch.parse(launch.build_parser(), ["ec2", "--config", path])
    assert (args.nodes, args.etcd, args.job, args.bucket) == (8, "auto", "llama-1b", "my-bamboo")
    cfg = job_config(train, args.nodes, args.job)
    s = cfg.schedule
    assert (cfg.model.name, s.stages, s.pipelines, s.microbatches) == ("hf:llama-1b", 4, 2, 16)
    assert cfg.recipe.precision == "bf16"
    assert cfg.data.data_files == ("s3://my-bamboo/data/train.bin",)
    assert cfg.checkpoints.checkpoint == "s3://my-bamboo/ckpt/llama-1b"
    assert cfg.recipe.betas == (0.9, 0.95) and cfg.recipe.lr_schedule == "cosine"
    assert cfg.cluster.elastic and cfg.cluster.job == "llama-1b"


def test_a_bad_frc_flag_is_one_line(capsys):
    assert "argument --frc: invalid choice: 'some'" in refusal(["--frc", "some"], capsys)
