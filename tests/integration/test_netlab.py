"""The network lab itself (commands/chaos/netlab.py): machines on one bridge reach
each other; a cut machine reaches nobody and nobody hears of it (a connection
attempt times out, it is not refused); a healed one is reachable again; a block
drops only the traffic between its two machines."""
import subprocess

import pytest

from commands.chaos.netlab import NetLab, unavailable

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}")

# a TCP connection from one machine to another's listener: prints ok, refused, timeout or the error
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except ConnectionRefusedError:
    print("refused")
except TimeoutError:
    print("timeout")
except OSError as e:
    print(f"error {e}")
"""
LISTEN = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); print('up', flush=True); " \
         "time.sleep(60)"


def probe(lab: NetLab, source: str, target: str, timeout: float = 1.0) -> str:
    out = subprocess.run([*lab.command(source), "python3", "-c", PROBE, lab.machines[target].address, "7000",
                          str(timeout)], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_cut_heal_and_block_do_what_a_lost_machine_does():
    with NetLab() as lab:
        for name in ("a", "b", "c"):
            lab.add(name)
        listeners = [subprocess.Popen([*lab.command(n), "python3", "-c", LISTEN], stdout=subprocess.PIPE, text=True)
                     for n in ("b", "c")]
        try:
            assert all(p.stdout.readline().strip() == "up" for p in listeners)
            assert probe(lab, "a", "b") == probe(lab, "a", "c") == "ok"
            assert probe(lab, "a", "a") == "refused"  # a machine's own closed port answers at once
            lab.cut("b")
            assert probe(lab, "a", "b") == "timeout"  # no reset, no refusal: silence
            assert probe(lab, "b", "c") == "timeout"
            assert probe(lab, "a", "c") == "ok"
            lab.heal("b")
            assert probe(lab, "a", "b", timeout=5.0) == "ok"
            lab.block("a", "c")
            assert probe(lab, "a", "c") == "timeout" and probe(lab, "c", "b") == "ok" and probe(lab, "a", "b") == "ok"
            lab.unblock("a", "c")
            assert probe(lab, "a", "c") == "ok"
        finally:
            for p in listeners:
                p.kill()
                p.wait()
    assert subprocess.run(["ip", "link", "show", lab.bridge], capture_output=True).returncode != 0  # all removed
