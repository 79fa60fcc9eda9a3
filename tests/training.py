"""Running bamboo-train from tests: one real command, its metrics read back."""
import json
import subprocess
import sys


def bamboo_train(metrics, *args, check=True, timeout=600):
    """Run `bamboo-train ARGS --metrics-out METRICS`; return (process, iteration
    records without the summary line)."""
    out = subprocess.run([sys.executable, "-m", "commands.train.cli", "--no-progress",
                          "--metrics-out", str(metrics), *args],
                         capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return out, [r for r in lines if "summary" not in r]


def redos(records) -> list[dict]:
    """The redo events of `records`, each without its abort's reason (`why`: the
    words of the node that gave the iteration up, checked where a test knows them)."""
    return [{k: v for k, v in e.items() if k != "why"} for r in records for e in r["events"] if e["type"] == "redo"]


def train_refusal(capsys, *args) -> tuple[int, str]:
    """bamboo-train's main in this process, for input it refuses before it starts
    anything (a process each would import torch again): its exit status and stderr.
    An exception escaping main fails the test, as a traceback would."""
    import signal

    from commands.train.cli import main
    handler = signal.getsignal(signal.SIGTERM)
    try:
        status = main(list(args))
    except SystemExit as e:  # argparse's refusals
        status = e.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    return status, capsys.readouterr().err
