"""`bamboo-train`: launch a training job. The argument contract is fixed here; the
worker runtime that runs it arrives with the runtime issue."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bamboo-train",
        description="Pipeline-parallel training that survives spot preemptions with redundant computation.")
    p.add_argument("--model", default="tiny", help="built-in model size: tiny, gpt2-small, bert-large")
    p.add_argument("--stages", type=int, default=2, help="pipeline depth P")
    p.add_argument("--pipelines", type=int, default=1, help="data-parallel pipelines D")
    p.add_argument("--microbatches", type=int, default=4, help="global microbatches per iteration M")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--redundancy", choices=("eager", "off"), default="eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", metavar="FILE", help="JSON lines, one per iteration")
    p.add_argument("--preempt", action="append", default=[], metavar="NODE@ITER[:INSTR]",
                   help="SIGKILL a worker at that point (repeatable), or 'random'")
    p.add_argument("--etcd", metavar="HOST:PORT", help="join an existing etcd instead of starting one")
    return p


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("bamboo-train: the worker runtime is not available yet; "
          "`python -m schedules demo` shows the schedules it will run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
