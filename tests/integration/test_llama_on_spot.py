"""docs/llama-on-spot.md, every command of it in its order, run for real here with
the test's settings: moto for AWS (AWS_ENDPOINT_URL), a local etcd for the job's,
sandboxes on this machine booting the nodes from the launch template's own user
data (tests/sandbox.py), a tokenizer built on the spot, hf:llama-tiny in float64.

The page's own commands do the work: tokenize into the bucket, the job file,
--plan, --estimate, the launch, status, dashboard, down, the relaunch that
continues from the checkpoint, the export. The test adds what the cloud does
(the nodes boot) and the checks: the losses of both launches and the exported
model's weights equal a single-process run of the same iterations."""
import base64
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request

import boto3
import pytest
import torch

from bamboo.control.cluster import Cluster
from bamboo.control.protocol import LOSS
from tests.integration.test_boot import wait_done
from tests.sample_tokenizer import save_tokenizer
from tests.sandbox import FakeMetadata, boot_log, run_script
from tests.training import bamboo_train

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "llama-on-spot.md"
BIN = os.path.dirname(sys.executable)
STEPS = ["tokenize", "job file", "plan", "estimate", "launch", "status", "dashboard", "down", "relaunch",
         "down again", "export"]
SETTINGS = {"BUCKET": "bamboo-e2e", "REGION": "us-east-1", "ZONES": "us-east-1a,us-east-1b",
            "ONE_ZONE": "us-east-1a", "ETCD": None, "IMAGE": None, "PROFILE": "bamboo-node", "INSTANCE": "g5.xlarge",
            "NODES": "2", "TOKENIZER": None, "MODEL": "hf:llama-tiny", "SEQ": "32", "DTYPE": "float64",
            "PRECISION": "fp32", "STAGES": "2", "MICROBATCHES": "4", "BATCH": "2", "ITERATIONS": "4", "EVERY": "2",
            "PORT": "0",  # any free port for the dashboard
            "WARMUP": "3"}  # the two launches' cosine schedules (4, then 6 iterations) agree on every iteration


def page() -> tuple[set[str], list[tuple[str, str]]]:
    """The names the settings block sets, and (step, script) of every later block."""
    text = DOC.read_text()
    settings, *steps = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert text.index("<!-- settings") < text.index(settings)
    names = set(re.findall(r"^([A-Z_]+)=", settings, re.M))
    return names, [(s.splitlines()[0].removeprefix("# step: "), s) for s in steps]


def run(script: str, cwd, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"{script}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


class Cloud:
    """What EC2 does once the group exists: its nodes boot from the template's user data."""

    def __init__(self, tmp_path, endpoint: str, settings: dict):
        self.tmp, self.endpoint, self.settings = tmp_path, endpoint, settings
        self.ec2 = boto3.client("ec2", region_name=settings["REGION"], endpoint_url=endpoint)
        self.metas, self.procs, self.boots = [], {}, 0
        (tmp_path / "wheelhouse").mkdir()

    def boot_nodes(self) -> None:
        version = self.ec2.describe_launch_template_versions(LaunchTemplateName="llama")["LaunchTemplateVersions"][0]
        script = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
        for _ in range(int(self.settings["NODES"])):
            self.boots += 1
            meta = FakeMetadata(self.settings["ONE_ZONE"], f"i-0{self.boots:04d}")
            root = self.tmp / f"node-{self.boots}"
            env = {"BAMBOO_METADATA": meta.url, "AWS_EC2_METADATA_SERVICE_ENDPOINT": meta.url,
                   "BAMBOO_EXPECT_GPUS": "0", "AWS_ENDPOINT_URL": self.endpoint, "BAMBOO_S3_ENDPOINT": self.endpoint,
                   "AWS_DEFAULT_REGION": self.settings["REGION"], "BAMBOO_DATA_CACHE": str(root / "cache")}
            self.procs[f"node {self.boots}"] = (run_script(script, root, self.tmp / "wheelhouse", env),
                                                lambda root=root: boot_log(root))
            self.metas.append(meta)

    def finish(self, etcd, last: int, first: int) -> list[float]:
        """Wait for iteration `last`, and every node's end; the losses from `first`."""
        cluster = Cluster(etcd.endpoint, "llama")
        try:
            wait_done(cluster, last, self.procs)
            for name, (proc, log) in self.procs.items():
                assert proc.wait(120) == 0, f"{name}: {log()[-3000:]}"
            m = int(self.settings["MICROBATCHES"])
            return [sum(cluster.children(LOSS(it))[g].value for g in range(m)) / m for it in range(first, last + 1)]
        finally:
            cluster.close()

    def close(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
        for meta in self.metas:
            meta.close()


def reference(work, env: dict, iterations: int) -> list[float]:
    """A single process trains the job file's model, schedule, recipe and data."""
    job = tomllib.loads((work / "llama.toml").read_text())
    flags = []
    for section in ("model", "schedule", "recipe", "data"):
        for key, value in job[section].items():
            for item in value if isinstance(value, list) else [value]:
                flags += [f"--{key.replace('_', '-')}", str(item)]
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "BAMBOO_S3_ENDPOINT", "BAMBOO_DATA_CACHE")})
    _, records = bamboo_train(work / "ref.jsonl", *flags, "--stages", "1", "--iterations", str(iterations),
                              "--export", str(work / "ref-hf"))
    return [r["loss"] for r in records]


@pytest.mark.slow  # four nodes booting from user data, two launches: about three minutes
def test_every_command_of_the_page_from_text_to_an_exported_model(tmp_path, moto_endpoint, etcd, monkeypatch):
    names, steps = page()
    assert names == set(SETTINGS) and [s for s, _ in steps] == STEPS
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": moto_endpoint, "BAMBOO_S3_ENDPOINT": moto_endpoint,
                 "BAMBOO_DATA_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=SETTINGS["BUCKET"])
    cloud = Cloud(tmp_path, moto_endpoint, SETTINGS)
    image = cloud.ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    settings = {**SETTINGS, "ETCD": etcd.endpoint, "IMAGE": image, "TOKENIZER": save_tokenizer(tmp_path / "tok")}
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **settings}
    work = tmp_path / "laptop"
    (work / "corpus").mkdir(parents=True)
    for source in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:12]:
        (work / "corpus" / f"{source.stem}.txt").write_text(source.read_text(errors="replace"))
    trained = []
    try:
        for step, script in steps:
            if step == "dashboard":
                check_dashboard(script, work, env)
                continue
            done = run(script, work, env)
            out = done.stdout
            if step == "relaunch":
                assert "continues from its newest checkpoint in s3://bamboo-e2e/ckpt/llama, taken before " \
                       "iteration 4" in done.stderr
            if step == "plan":
                assert "fits g5.xlarge" in out
            if step == "estimate":
                assert "cheapest: " in out and json.loads(out.splitlines()[-1])["estimate"]
            if step in ("launch", "relaunch"):
                cloud.boot_nodes()
                last = int(settings["ITERATIONS"]) * (3 if step == "relaunch" else 2) // 2 - 1
                trained += cloud.finish(etcd, last, first=len(trained))
            if step == "status":
                assert json.loads(out)["progress"]["state"] == "finished"
            if step == "export":
                assert out.strip().splitlines()[-1].isdigit()  # the parameters from_pretrained counted
        assert len(trained) == 6
        assert trained == pytest.approx(reference(work, env, 6), rel=1e-9, abs=1e-12)
        assert_same_weights(work / "llama-hf", work / "ref-hf")
    finally:
        cloud.close()


def check_dashboard(script: str, work, env: dict) -> None:
    """The page's dashboard command serves the job while it runs."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "dashboard at http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
    job = json.load(urllib.request.urlopen(line.split(" at ")[1].split()[0] + "api/job", timeout=30))
    assert job["job"] == "llama" and job["state"] == "finished"
    assert proc.wait(60) == 0


def assert_same_weights(exported, reference) -> None:
    from transformers import AutoModelForCausalLM
    ours, theirs = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float64).state_dict()
                    for d in (exported, reference))
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.allclose(tensor, theirs[name], rtol=1e-9, atol=1e-12), name
