"""`bamboo-status --etcd HOST:PORT [--job NAME] [--json]`: what the jobs in an etcd
are doing, read from their keys: depth and pipelines, live and failed nodes, the
last finished iteration and the recent iteration rate."""
from __future__ import annotations

import argparse
import json
import sys

from bamboo.cluster import Cluster
from bamboo.etcd import EtcdError, connect


def jobs(endpoint: str) -> list[str]:
    client = connect(endpoint)
    names = {meta.key.decode().split("/")[2] for _, meta in client.get_prefix("/bamboo/")}
    client.close()
    return sorted(n for n in names if n != "rdzv")


def job_status(endpoint: str, job: str) -> dict:
    cluster = Cluster(endpoint, job)
    cfg = cluster.get("config") or {}
    done: dict[int, dict] = {}
    for key, value in cluster.children("done").items():
        it, _, node = key.partition("/")
        done.setdefault(int(it), {})[node] = value
    failed = cluster.children("failed")
    nodes = cfg.get("stages", 0) * cfg.get("pipelines", 0)
    complete = [it for it, reports in done.items()
                if all(str(n) in reports or str(n) in failed for n in range(nodes))]
    last = max(complete, default=None)
    times = sorted(max(r.get("time", 0) for r in done[it].values()) for it in complete)[-11:]
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    status = {"job": job, "model": cfg.get("model"), "stages": cfg.get("stages"), "pipelines": cfg.get("pipelines"),
              "iterations": cfg.get("iterations"), "last_iteration": last,
              "iterations_per_second": round(rate, 3) if rate else None,
              "alive": sorted(cluster.alive()),
              "failed": {int(n): f for n, f in sorted(failed.items(), key=lambda kv: int(kv[0]))}}
    cluster.close()
    return status


def render(status: dict) -> str:
    lines = [f"job {status['job']}: {status['model']}, P={status['stages']} x D={status['pipelines']}, "
             f"iteration {status['last_iteration']} of {status['iterations']}"
             + (f", {status['iterations_per_second']} it/s" if status["iterations_per_second"] else "")]
    lines.append(f"  alive:  {' '.join(map(str, status['alive'])) or '-'}")
    for n, f in status["failed"].items():
        lines.append(f"  failed: node {n} in iteration {f.get('iteration')} ({f.get('how', '?')[:60]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bamboo-status", description=__doc__.splitlines()[0])
    ap.add_argument("--etcd", required=True, metavar="HOST:PORT")
    ap.add_argument("--job", help="one job (default: every job in this etcd)")
    ap.add_argument("--json", action="store_true", help="one JSON object per job")
    args = ap.parse_args(argv)
    try:
        names = [args.job] if args.job else jobs(args.etcd)
        for name in names:
            status = job_status(args.etcd, name)
            print(json.dumps(status) if args.json else render(status))
        if not names:
            print("no jobs", file=sys.stderr)
    except EtcdError as e:
        print(f"bamboo-status: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
