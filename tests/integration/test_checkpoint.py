"""Checkpoints: round trips, interrupted writes, S3 through a real moto server, GCS
through the fake Cloud Storage (tests/fake_gcs.py) with the real client, and
resumed runs (local and gs://) that continue exactly where the checkpoint was taken."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from bamboo.model.api import ModelSource
from bamboo.model.builtin import dropout_seed
from bamboo.data.checkpoint_files import Attempt, GcsStorage, LocalStorage, S3Storage, latest, prune, write_part
from bamboo.state.checkpoint import restore, snapshot
from tests.training import bamboo_train, train_refusal


def _layers_and_optimizer(seed=0):
    source = ModelSource("tiny", seed=seed)
    layers = {i: source.layer(i) for i in range(source.count)}
    opt = torch.optim.AdamW([p for m in layers.values() for p in m.parameters()], lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    h = x
    with dropout_seed(1):
        for i in range(source.count):
            h = layers[i](h)
    source.loss(h, x).backward()
    opt.step()
    return layers, opt


def _same(layers_a, opt_a, layers_b, opt_b):
    for i in layers_a:
        for (name, p), q in zip(layers_a[i].named_parameters(), layers_b[i].parameters()):
            assert torch.equal(p, q), name
            for k, v in opt_a.state[p].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_b.state[q][k])), (name, k)


def test_round_trip_restores_parameters_and_optimizer_state(tmp_path):
    layers, opt = _layers_and_optimizer()
    storage = LocalStorage(str(tmp_path))
    blobs = snapshot(layers, opt)
    five = Attempt(5, "run-e000001")
    assert not write_part(storage, five, 0, {k: v for k, v in blobs.items() if k < 4}, layers=len(layers))
    assert latest(storage, len(layers)) is None  # half the layers: not committed
    assert write_part(storage, five, 1, {k: v for k, v in blobs.items() if k >= 4}, layers=len(layers))
    assert (tmp_path / "ckpt-00000005-run-e000001" / "commit.json").exists()
    it, found = latest(storage, len(layers))
    fresh, fresh_opt = _layers_and_optimizer(seed=9)
    fresh_opt.state.clear()
    for i, blob in found.items():
        restore(blob, fresh[i], fresh_opt)
    assert it == 5
    _same(layers, opt, fresh, fresh_opt)


def test_corrupted_newer_checkpoint_falls_back_to_the_older_one(tmp_path):
    layers, opt = _layers_and_optimizer()
    storage = LocalStorage(str(tmp_path))
    write_part(storage, Attempt(3, "run-e000000"), 0, snapshot(layers, opt), layers=len(layers))
    write_part(storage, Attempt(6, "run-e000000"), 0, snapshot(layers, opt), layers=len(layers))
    (tmp_path / "ckpt-00000006-run-e000000" / "layer2.pt").write_bytes(b"torn")
    assert latest(storage, len(layers))[0] == 3


def test_two_attempts_at_one_checkpoint_never_mix(tmp_path):
    """A redo (epoch 2) takes checkpoint 6 again after epoch 1's writers wrote half
    of it and died: each attempt has its folder, and neither half is taken for a
    whole. The redo's attempt, once complete, is the one read."""
    storage = LocalStorage(str(tmp_path))
    first = {i: b"first %d" % i for i in range(4)}
    redo = {i: b"redo %d" % i for i in range(4)}
    write_part(storage, Attempt(6, "run-e000001"), 0, {0: first[0], 1: first[1]}, layers=4)
    write_part(storage, Attempt(6, "run-e000002"), 1, {2: redo[2], 3: redo[3]}, layers=4)
    assert latest(storage, 4) is None  # the two halves together would name every layer
    write_part(storage, Attempt(6, "run-e000002"), 0, {0: redo[0], 1: redo[1]}, layers=4)
    assert latest(storage, 4) == (6, redo)


def test_keep_removes_all_but_the_newest_committed_checkpoints(tmp_path):
    """--checkpoint-keep 2: after each commit, the newest two committed checkpoints
    stay; an attempt that never committed goes once it is older than both; one
    being written (newer) stays."""
    storage = LocalStorage(str(tmp_path))
    write_part(storage, Attempt(1, "run-e000000"), 0, {0: b"a"}, layers=2)  # never completed
    for it in (2, 4, 6):
        write_part(storage, Attempt(it, "run-e000000"), 0, {i: b"%d-%d" % (it, i) for i in range(2)}, layers=2,
                   keep=2)
    write_part(storage, Attempt(8, "run-e000000"), 0, {0: b"b"}, layers=2, keep=2)  # in progress
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004-run-e000000", "ckpt-00000006-run-e000000",
                                            "ckpt-00000008-run-e000000"]
    assert latest(storage, 2) == (6, {0: b"6-0", 1: b"6-1"})
    assert prune(storage, Attempt(6, "run-e000000"), 1) == [Attempt(4, "run-e000000")]
    assert latest(storage, 2, at_most=5) is None


def test_keep_never_removes_what_it_just_wrote_nor_another_runs(tmp_path):
    """A new run in a place an earlier run used (its checkpoints at higher
    iterations), and a rollback below the run's own newest: the commit just made
    stays, the earlier run's files stay, and the run keeps `keep` iterations."""
    storage = LocalStorage(str(tmp_path))
    for it in (100, 200):
        write_part(storage, Attempt(it, "0a0b0c0d1111-e000003"), 0, {0: b"old"}, layers=1)
    write_part(storage, Attempt(10, "0a0b0c0e2222-e000000"), 0, {0: b"new 10"}, layers=1, keep=1)
    assert latest(storage, 1, at_most=10) == (10, {0: b"new 10"})
    write_part(storage, Attempt(20, "0a0b0c0e2222-e000000"), 0, {0: b"new 20"}, layers=1, keep=2)
    write_part(storage, Attempt(12, "0a0b0c0e2222-e000004"), 0, {0: b"redo 12"}, layers=1, keep=2)  # rolled back
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000012-0a0b0c0e2222-e000004", "ckpt-00000020-0a0b0c0e2222-e000000",
                                            "ckpt-00000100-0a0b0c0d1111-e000003", "ckpt-00000200-0a0b0c0d1111-e000003"]


def test_write_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    layers, opt = _layers_and_optimizer()
    storage = LocalStorage(str(tmp_path))
    write_part(storage, Attempt(3, "run-e000000"), 0, snapshot(layers, opt), layers=len(layers))
    code = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
from bamboo.data.checkpoint_files import Attempt, LocalStorage, write_part
storage = LocalStorage({str(tmp_path)!r})
class Slow(LocalStorage):
    def put(self, key, data):
        super().put(key, data)
        print("wrote", key, flush=True)
        time.sleep(0.3)
blobs = {{i: bytes(1000) * (i + 1) for i in range(8)}}
write_part(Slow({str(tmp_path)!r}), Attempt(6, "run-e000000"), 0, blobs, layers=8)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "ckpt-00000006-run-e000000" / "layer0.pt").exists()
    assert not (tmp_path / "ckpt-00000006-run-e000000" / "commit.json").exists()
    it, blobs = latest(storage, len(layers))
    assert it == 3 and len(blobs) == len(layers)


def test_s3_checkpoints_through_boto3(moto_endpoint, monkeypatch):
    import boto3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket="ckpts")
    storage = S3Storage("s3://ckpts/job1", client)
    layers, opt = _layers_and_optimizer()
    for it in (2, 4):
        write_part(storage, Attempt(it, "run-e000000"), 0, snapshot(layers, opt), layers=len(layers), keep=1)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="ckpts")["Contents"]}
    assert "job1/ckpt-00000004-run-e000000/commit.json" in keys and len(keys) == len(layers) + 2  # 2: removed
    it, blobs = latest(storage, len(layers))
    assert it == 4 and set(blobs) == set(layers)


def test_gcs_checkpoints_through_google_cloud_storage(gcs):
    gcs.page_size = 3  # listings come in pages: every key must still be found
    storage = GcsStorage("gs://ckpts/job1")
    layers, opt = _layers_and_optimizer()
    for it in (2, 4):
        write_part(storage, Attempt(it, "run-e000000"), 0, snapshot(layers, opt), layers=len(layers), keep=1)
    names = {name for bucket, name in gcs.objects if bucket == "ckpts"}
    assert "job1/ckpt-00000004-run-e000000/commit.json" in names and len(names) == len(layers) + 2  # 2: removed
    it, blobs = latest(storage, len(layers))
    assert it == 4 and set(blobs) == set(layers)
    with pytest.raises(KeyError):
        storage.get("ckpt-00000009-run-e000000/layer0.pt")


@pytest.mark.slow
def test_a_run_resumed_from_gcs_continues_exactly(tmp_path, gcs):
    """The first run writes checkpoints to gs:// and is the uninterrupted reference;
    its newest checkpoint removed, the second resumes from the one before iteration 2."""
    def train(name, *args):
        return bamboo_train(tmp_path / name, "--stages", "2", "--microbatches", "4", "--dtype", "float64",
                            "--checkpoint", "gs://ckpts/run", *args)[1]

    whole = train("whole.jsonl", "--iterations", "4", "--checkpoint-every", "2")
    two = [k for k in gcs.objects if k[0] == "ckpts" and k[1].startswith("run/ckpt-00000002-")]
    assert any(k[1].endswith("/commit.json") for k in two)
    for key in [k for k in gcs.objects if k[0] == "ckpts" and k not in two]:
        del gcs.objects[key]
    resumed = train("resumed.jsonl", "--iterations", "4", "--resume")
    assert [r["iteration"] for r in resumed] == [2, 3]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-12)


@pytest.mark.slow  # make test stays under 15 minutes; make test-slow runs it
def test_resumed_run_continues_exactly(tmp_path):
    def train(*args):
        metrics = tmp_path / f"m{len(os.listdir(tmp_path))}.jsonl"
        return bamboo_train(metrics, "--stages", "2", "--microbatches", "4", "--dtype", "float64", *args)[1]

    whole = train("--iterations", "6")
    ck = str(tmp_path / "ck")
    train("--iterations", "4", "--checkpoint", ck, "--checkpoint-every", "3")
    resumed = train("--iterations", "6", "--checkpoint", ck, "--resume")
    assert [r["iteration"] for r in resumed] == [3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[3:]], rel=1e-12)


def test_resume_without_a_checkpoint_is_one_clear_error(tmp_path, capsys):
    status, err = train_refusal(capsys, "--stages", "2", "--iterations", "2", "--no-progress", "--checkpoint",
                                str(tmp_path / "none"), "--resume")
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and "no complete checkpoint" in lines[0], err


@pytest.mark.slow  # make test stays under 15 minutes on a 2-core machine
def test_checkpoints_by_time_are_agreed_and_complete(tmp_path):
    """--checkpoint-seconds: the node writing each barrier record decides, so every
    checkpoint is one iteration's, complete; fewer than one per iteration."""
    ck = tmp_path / "ck"
    records = bamboo_train(tmp_path / "m.jsonl", "--stages", "2", "--microbatches", "4", "--iterations", "30",
                           "--checkpoint", str(ck), "--checkpoint-seconds", "0.4")[1]
    seconds = sum(r["seconds"] for r in records[1:])
    taken = sorted(int(d.split("-")[1]) for d in os.listdir(ck))
    assert 1 <= len(taken) <= 30 and len(taken) <= seconds / 0.4 + 2, (taken, seconds)
    storage = LocalStorage(str(ck))
    assert latest(storage, ModelSource("tiny", seed=0).count)[0] == taken[-1]  # the newest is complete


def test_a_job_of_agents_restarted_with_resume_continues_exactly(tmp_path):
    """A job with agents that ended (or was torn down) after a checkpoint, started
    again with --resume into the same place: its agents start the first epoch from
    the newest committed checkpoint, and the losses go on as one run's would."""
    def train(*args):
        metrics = tmp_path / f"m{len(os.listdir(tmp_path))}.jsonl"
        return bamboo_train(metrics, "--stages", "2", "--microbatches", "4", "--dtype", "float64", *args,
                            timeout=300)[1]

    whole = train("--iterations", "6")  # the single pipeline without agents: the same math
    ck = str(tmp_path / "ck")
    agents = ["--local-nodes", "3", "--zones", "a,b", "--checkpoint", ck, "--surplus", "keep"]
    first = train("--iterations", "4", *agents, "--checkpoint-every", "3")
    assert [r["iteration"] for r in first] == [0, 1, 2, 3]
    resumed = train("--iterations", "6", *agents, "--resume")
    assert [r["iteration"] for r in resumed] == [3, 4, 5]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[3:]], rel=1e-12)
