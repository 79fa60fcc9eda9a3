"""The command line: the JSON exchange format (checked by an independent reader
written here), error handling, rendering and the demo."""
import json
import subprocess
import sys
from collections import defaultdict

import pytest

SEND = {"send_act": "act", "send_grad": "grad", "send_sync": "sync"}
RECV = {"recv_act": "act", "recv_grad": "grad", "recv_sync": "sync"}


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "schedules", *args], capture_output=True, text=True, cwd=cwd)


def dump(*args):
    out = run("dump", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def check_channels(doc):
    """Independent of the simulator: per (sender, receiver, kind), the sequence sent
    equals the sequence received, so messages pair up in order."""
    sent, received = defaultdict(list), defaultdict(list)
    for stream in doc["streams"]:
        me = stream["node"]
        for ins in stream["instructions"]:
            key = (ins.get("stage"), ins.get("mb"))
            if ins["op"] in SEND:
                sent[(me, ins["peer"], SEND[ins["op"]])].append(key)
            elif ins["op"] in RECV:
                received[(ins["peer"], me, RECV[ins["op"]])].append(key)
    assert dict(sent) == dict(received)


@pytest.mark.parametrize("frc", ["bubbles", "all"])
def test_dump_fault_free_eager_matches_the_contract(frc):
    """(Whole backwards: split ones take waits that FRC had, tests/integration/test_early_grads.py.)"""
    doc = dump("--stages", "4", "--microbatches", "6", "--frc", frc, "--backward-split", "off")
    assert (doc["stages"], doc["microbatches"], doc["failed"], doc["frc"]) == (4, 6, [], frc)
    assert [s["node"] for s in doc["streams"]] == [0, 1, 2, 3]
    check_channels(doc)
    first = doc["streams"][0]["instructions"][:3]
    assert first == [{"op": "load", "mb": 0}, {"op": "forward", "stage": 0, "mb": 0, "redundant": False},
                     {"op": "send_act", "stage": 0, "mb": 0, "peer": 1}]
    covered = []
    for s in doc["streams"]:
        m, ins = s["node"], s["instructions"]
        frc_mbs = [i["mb"] for i in ins if i["op"] == "forward" and i["redundant"]]
        assert s["frc"] == frc_mbs == list(range(len(frc_mbs)))  # in order, from the first
        covered.append(len(frc_mbs))
        assert all(i["stage"] == (m + 1) % 4 for i in ins if i["op"] == "forward" and i["redundant"])
        assert not any(i["op"] == "backward" and i["redundant"] for i in ins)
        brc = s["lazy_brc"]  # what the FRC left for a recovery: swap in where it ran, else recompute
        assert [i["op"] for i in brc[0::2]] == ["swap_in"] * len(frc_mbs) + ["forward"] * (6 - len(frc_mbs))
        assert {i["op"] for i in brc[1::2]} == {"backward"}
    assert covered == [6] * 4 if frc == "all" else min(covered) < 6 and covered[3] == 6


def test_dump_without_redundancy_has_no_redundant_work():
    doc = dump("--stages", "3", "--microbatches", "2", "--redundancy", "off")
    check_channels(doc)
    assert not any(i.get("redundant") for s in doc["streams"] for i in s["instructions"])


def test_dump_failed_node_is_merged_into_its_predecessor():
    doc = dump("--stages", "4", "--microbatches", "3", "--failed", "2")
    check_channels(doc)
    assert [s["node"] for s in doc["streams"]] == [0, 1, 3]
    node1 = doc["streams"][1]["instructions"]
    for stage in (1, 2):
        for ops in (("forward",), ("backward", "backward_input"), ("backward", "backward_weight")):
            assert sorted(i["mb"] for i in node1 if i["op"] in ops and i["stage"] == stage
                          and not i.get("redundant")) == [0, 1, 2]


def test_dump_mid_iteration_failure():
    doc = dump("--stages", "4", "--microbatches", "4", "--fail-node", "1", "--fail-before", "9")
    assert (doc["fail_node"], doc["fail_before"]) == (1, 9)
    assert [s["node"] for s in doc["streams"]] == [0, 2, 3]
    node0 = doc["streams"][0]["instructions"]
    assert sorted(i["mb"] for i in node0 if i["op"] == "backward" and i["stage"] == 1) == [0, 1, 2, 3]
    assert all("resume_at" in s for s in doc["streams"])


def test_dump_with_compute_ahead_begins_stage_0_with_more_forwards():
    doc = dump("--stages", "2", "--microbatches", "8", "--redundancy", "off", "--compute-ahead")
    check_channels(doc)
    assert doc["compute_ahead"] is True
    first = doc["streams"][0]["instructions"]
    warm = next(k for k, i in enumerate(first) if i["op"] == "recv_grad")
    assert [i["mb"] for i in first[:warm] if i["op"] == "forward"] == [0, 1, 2, 3]  # 1F1B's warm-up: 0 and 1


def test_dump_evaluation_streams_forward_only():
    doc = dump("--eval", "--stages", "4", "--microbatches", "3", "--failed", "0")
    assert doc["evaluation"] is True and [s["node"] for s in doc["streams"]] == [1, 2, 3]
    check_channels(doc)
    node3 = doc["streams"][2]["instructions"]  # stages 0 and 3: loads once per microbatch, both forwards
    assert sorted((i["stage"], i["mb"]) for i in node3 if i["op"] == "forward") == [
        (s, mb) for s in (0, 3) for mb in range(3)]
    assert [i["mb"] for i in node3 if i["op"] == "load"] == [0, 1, 2]
    assert {i["op"] for s in doc["streams"] for i in s["instructions"]} == {"load", "forward", "send_act", "recv_act"}


@pytest.mark.parametrize("args,message", [
    (["--stages", "1"], "at least 2"),
    (["--microbatches", "0"], "at least 1"),
    (["--failed", "7"], "out of range"),
    (["--failed", "1", "2"], "adjacent"),
    (["--fail-node", "1"], "go together"),
    (["--stages", "x"], "invalid int"),
    (["--redundancy", "auto"], "invalid choice"),
    (["--frc", "some"], "invalid choice"),
    (["--eval", "--fail-node", "1", "--fail-before", "2"], "no mid-iteration failure"),
    (["--eval", "--compute-ahead"], "no backward to order"),
    (["--forward", "nan"], "forward must be a finite number"),  # once printed as JSON no parser reads
    (["--transfer", "inf"], "transfer must be a finite number"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, message):
    out = run("dump", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize("args,message", [
    (["render", "--out", "/proc/no/x.png"], "--out '/proc/no/x.png': cannot write a PNG there"),
    (["render", "--out", "."], "cannot write a PNG there"),
    (["render", "--no-png", "--width", "0"], "--width must be at least 1"),
    (["demo", "--out-dir", __file__], "is a file, not a directory"),
])
def test_an_output_that_cannot_be_written_is_one_line_before_any_output(args, message):
    out = run(*args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(lines) == 1 and message in lines[0], out.stderr


def test_render_writes_png_and_text(tmp_path):
    png = tmp_path / "t.png"
    out = run("render", "--stages", "3", "--microbatches", "4", "--out", str(png), "--width", "60")
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line for line in out.stdout.splitlines() if line.startswith("node")]
    assert len(rows) == 3 and all("f" in r and "F" in r and "B" in r for r in rows)


def test_demo_runs(tmp_path):
    out = run("demo", "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "eager FRC / no redundancy" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "schedule-eager.png", "schedule-no-redundancy.png", "schedule-recovery.png"]


def test_bamboo_train_help_works():
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--stages" in out.stdout and "--redundancy" in out.stdout


TRAIN_GROUPS = ("model", "schedule and redundancy", "recipe", "data", "checkpoints and outputs",
                "faults and liveness", "devices", "cluster", "testing and diagnostics")
PLAN_GROUP = "plan (print, check and exit: nothing is started)"  # a check, not a job: no job-file section


def help_groups(text: str) -> dict[str, tuple[str, list[str]]]:
    """--help's groups as printed: title -> (description, option strings in order)."""
    groups, title = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            title = line[:-1]
            groups[title] = ("", [])
        elif title and line.startswith("  -"):  # an entry: its names, then its metavar and help
            for token in line.split():
                if not token.startswith("-"):
                    break
                groups[title][1].append(token.rstrip(","))
        elif title and line.startswith("  ") and not groups[title][1] and not groups[title][0]:
            groups[title] = (line.strip(), [])
    return groups


def test_bamboo_train_help_shows_every_flag_once_in_its_group():
    from commands.train import cli, jobfile
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    groups = help_groups(out.stdout)
    assert list(groups) == ["options", *TRAIN_GROUPS, PLAN_GROUP]
    assert groups[PLAN_GROUP][1] == ["--plan", "--propose", "--instance-type", "--gpu-memory", "--host-memory"]
    shown = [name for _, names in groups.values() for name in names]
    every = [name for action in cli.build_parser()._actions for name in action.option_strings]
    assert len(shown) == len(set(shown)) and sorted(shown) == sorted(every) and len(every) == 86
    assert groups["options"][1] == ["-h", "--help", "--config"]
    for title, flag in (("model", "--model"), ("schedule and redundancy", "--redundancy"), ("recipe", "--lr"),
                        ("data", "--val-data"), ("checkpoints and outputs", "--checkpoint"),
                        ("faults and liveness", "--hang-timeout"), ("devices", "--devices"),
                        ("cluster", "--local-nodes"), ("testing and diagnostics", "--preempt")):
        assert flag in groups[title][1]
    sections = jobfile.sections(cli.build_parser())  # each group is the job file's section its help names
    for title in TRAIN_GROUPS:
        description, names = groups[title]
        section = description.removeprefix("in a --config file: [").removesuffix("]")
        assert names == [f"--{key.replace('_', '-')}" for key in sections[section]], title


def test_bamboo_train_bad_config_is_one_line_even_with_help(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[schedule]\nstages = 3\n[recipe]\nlr = 'fast'\n")
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--config", str(job), "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"bamboo-train: error: {job}: [recipe] lr: expected a number, got 'fast'"]
