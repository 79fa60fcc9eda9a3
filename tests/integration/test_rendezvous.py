"""torch elastic's dynamic rendezvous over our etcd backend, with real processes."""
import subprocess
import sys

import pytest

from agents.rendezvous import EtcdRendezvousBackend
from bamboo.control.etcd import EtcdServer, connect


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


def test_backend_is_a_fenced_compare_and_set(etcd):
    backend = EtcdRendezvousBackend(connect(etcd.endpoint), "/t/rdzv")
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"one")
    assert ok and state == b"one"
    assert backend.set_state(b"two") == (b"one", token, False)            # exists: not overwritten
    assert backend.set_state(b"three", token)[::2] == (b"three", True)    # right token: updated
    state, token2, ok = backend.set_state(b"four", token)                 # stale token: refused
    assert (state, ok) == (b"three", False) and token2 != token


def test_two_agents_meet_through_etcd(etcd):
    code = """
import sys
from agents.rendezvous import rendezvous_handler
h = rendezvous_handler(sys.argv[1], "run1", min_nodes=2, max_nodes=2, last_call_timeout=1, join_timeout=60)
info = h.next_rendezvous()
print(info.rank, info.world_size, flush=True)
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, etcd.endpoint], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-800:] for o in outs]
    assert sorted(o[0].split()[0] for o in outs) == ["0", "1"]
    assert all(o[0].split()[1] == "2" for o in outs)
