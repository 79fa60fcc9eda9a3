"""Every pip install on a node takes the checkout's constraints.txt, pin for pin."""
import pathlib

from cloud.common import Install, NodeLines, boot_script, pins

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_the_nodes_pins_are_constraints_txt():
    lines = [line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    script = boot_script(Install("https://example.com/b.whl"), "10.0.0.5:2379", "j",
                         NodeLines("ec2", "http://169.254.169.254", "ZONE=a; INSTANCE=i"))
    written = script.split("<<'PINS'\n", 1)[1].split("\nPINS\n", 1)[0]
    assert written.splitlines() == lines and "torch==2.13.0" in lines
    assert 'pip install --quiet -c "$ROOT/opt/constraints.txt"' in script


def test_without_a_checkout_torch_alone_is_pinned(tmp_path):
    assert pins(str(tmp_path / "absent.txt")) == "torch==2.13.0"
