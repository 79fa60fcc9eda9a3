"""Device selection (bamboo/transport/devices.py): one GPU per worker of a host, the
--devices list, --share-gpu, the transport, and the launcher's LOCAL_RANK."""
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from bamboo.control.config import JobConfig
from bamboo.transport.devices import DeviceError, parse_devices, pick, transport
from tests.training import train_refusal


def test_each_worker_of_a_host_takes_the_gpu_of_its_index():
    assert [pick(r, (), 4, False) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert [pick(r, ("3", "1"), 4, False) for r in range(2)] == [torch.device("cuda", 3), torch.device("cuda", 1)]


def test_no_gpu_or_cpu_asked_for_means_the_cpu():
    assert pick(5, (), 0, False) == torch.device("cpu")
    assert pick(0, ("cpu",), 8, False) == torch.device("cpu")


def test_more_workers_than_gpus_is_an_error_unless_sharing_is_asked_for():
    with pytest.raises(DeviceError, match="--share-gpu"):
        pick(2, (), 2, False)
    with pytest.raises(DeviceError, match="--share-gpu"):
        pick(1, ("0",), 2, False)
    assert [pick(r, (), 2, True) for r in range(5)] == [torch.device("cuda", r % 2) for r in range(5)]
    assert [pick(r, ("1",), 2, True) for r in range(3)] == [torch.device("cuda", 1)] * 3


def test_devices_the_host_does_not_have_or_malformed_are_refused():
    with pytest.raises(DeviceError, match="GPU 2, but this host has 2"):
        pick(0, ("0", "2"), 2, False)
    for bad in ("a,b", "0,0", "-1", "cpu,0"):
        with pytest.raises(DeviceError):
            parse_devices(bad)
    assert parse_devices("2, 0") == ("2", "0") and parse_devices(None) == ()


def test_the_transport_is_gloo_unless_nccl_is_asked_and_possible():
    assert transport("auto", torch.device("cuda", 0), False) == "gloo"
    assert transport("gloo", torch.device("cpu"), False) == "gloo"
    with pytest.raises(DeviceError, match="needs a GPU"):
        transport("nccl", torch.device("cpu"), False)
    with pytest.raises(DeviceError, match="cannot share"):
        transport("nccl", torch.device("cuda", 0), True)
    if dist.is_nccl_available():
        assert transport("nccl", torch.device("cuda", 0), False) == "nccl"
    else:  # this machine's CPU build of torch
        with pytest.raises(DeviceError, match="this torch build has no NCCL"):
            transport("nccl", torch.device("cuda", 0), False)


@pytest.mark.parametrize("flags, says", [
    (["--devices", "0,x"], "--devices takes GPU indices"),
    (["--transport", "nccl"], "--transport nccl needs a GPU"),
    (["--transport", "nccl", "--share-gpu"], "--transport nccl cannot share a GPU"),
    (["--compute-ahead", "--devices", "0"], "--compute-ahead runs its thread on CPU workers only"),
])
def test_bamboo_train_refuses_device_flags_in_one_line(flags, says, capsys):
    status, err = train_refusal(capsys, "--stages", "2", "--iterations", "1", *flags)
    assert status == 2
    assert err.strip().count("\n") == 0 and says in err, err


def test_the_launcher_gives_each_local_process_the_lowest_free_index(tmp_path, monkeypatch):
    """LOCAL_RANK reaches every worker (and agent, whose worker inherits it); the
    index of a process that exited goes to the next one started."""
    from commands.train.launcher import Launcher

    started = []

    class Popen:
        def __init__(self, args, env=None, **kwargs):
            self.exited = None
            self.pid = os.getpid()  # not a child: the launcher's clock finds it gone at once
            started.append((self, env))

        def poll(self):
            return self.exited
    monkeypatch.setattr(subprocess, "Popen", Popen)
    launcher = Launcher(JobConfig.of(job="j"))
    launcher.logs = str(tmp_path)

    class Cluster:
        endpoint = "127.0.0.1:1"
    for node in (0, 1, 2):
        launcher._start(Cluster(), node, "bamboo.runtime.worker")
    started[1][0].exited = -9  # node 1 was killed: its GPU is free
    launcher._start(Cluster(), 7, "agents.agent", named=False)
    launcher._start(Cluster(), 8, "agents.agent", named=False)
    assert [env["LOCAL_RANK"] for _, env in started] == ["0", "1", "2", "1", "3"]
