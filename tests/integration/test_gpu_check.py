"""A node whose machine lacks the GPUs its type promises (an image without the
NVIDIA driver, say) says so in the job's etcd, one line, and its agent exits
with status 1, which the boot script's end turns into leaving the group
(cloud/node_exit.py); bamboo-status and bamboo-launch status show the line."""
import os
import subprocess
import sys

import torch

from bamboo.control.cluster import Cluster
from bamboo.control.config import JobConfig
from bamboo.control.protocol import CONFIG, ERROR
from commands.status.status import job_status

BIN = os.path.dirname(sys.executable)


def test_a_machine_without_its_gpus_records_one_line_and_exits_1(etcd):
    cluster = Cluster(etcd.endpoint, "no-gpu")
    cluster.put(CONFIG(), JobConfig.of(job="no-gpu", stages=2, elastic=True))
    expected = torch.cuda.device_count() + 1  # one more than this machine has
    out = subprocess.run([os.path.join(BIN, "bamboo-agent"), "--etcd", etcd.endpoint, "--job", "no-gpu",
                          "--zone", "a", "--expect-gpus", str(expected)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"no GPU: this machine should have {expected}" in out.stderr and "NVIDIA driver" in out.stderr
    ((node, error),) = cluster.children(ERROR()).items()
    assert error.message in out.stderr
    assert job_status(etcd.endpoint, "no-gpu")["errors"] == {node: error.message}
    cluster.close()


def test_a_machine_with_them_passes_the_check(etcd):
    from agents.agent import missing_gpus
    assert missing_gpus(torch.cuda.device_count()) is None and missing_gpus(0) is None
