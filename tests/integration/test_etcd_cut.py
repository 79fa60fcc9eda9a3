"""etcd from a machine whose link was cut and healed: the client answers again
within seconds of the heal, not after TCP's doubling retransmission gaps (the agent
of chaos seed 27 gave up 20 s into a 10 s cut). A real etcd in one network namespace,
the client in another, the traffic between them dropped silently (commands/chaos/netlab.py)."""
import pathlib
import subprocess
import sys
import time

import pytest

from bamboo.control.etcd import EtcdServer
from commands.chaos.netlab import NetLab, unavailable

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}")

# Reads one key once a tenth of a second with bamboo's client; prints each outcome's wall time.
CLIENT = """
import sys, time
from bamboo.control.etcd import connect
client = connect(sys.argv[1], timeout=1.0, tls=None)
client.put("k", "v")
print("up", flush=True)
while True:
    began = time.time()
    try:
        client.get("k")
        print("ok", began, flush=True)
    except Exception as e:
        print("failed", began, type(e).__name__, flush=True)
    time.sleep(0.1)
"""


def test_a_healed_cut_is_answered_within_seconds():
    with NetLab() as lab:
        lab.add("c")
        lab.add("e")
        with EtcdServer(host=lab.machines["e"].address, prefix=tuple(lab.command("e"))) as etcd:
            client = subprocess.Popen([*lab.command("c"), sys.executable, "-c", CLIENT, etcd.endpoint],
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)
            try:
                assert client.stdout.readline().strip() == "up"
                lab.block("c", "e")
                blocked = time.time()
                while client.stdout.readline().split()[0] != "failed":  # one sent before the block may answer
                    assert time.time() < blocked + 8.0, "the block did not stop the client's requests"
                while time.time() < blocked + 8.0:  # a cut of 8 s, as chaos's etcd-cut
                    client.stdout.readline()
                lab.unblock("c", "e")
                healed = time.time()
                while not ((line := client.stdout.readline().split())[0] == "ok" and float(line[1]) >= healed):
                    assert time.time() < healed + 30, "no answer 30 s after the heal"
                assert float(line[1]) - healed < 3.0, f"first answer {float(line[1]) - healed:.1f} s after the heal"
            finally:
                client.kill()
                client.wait()
