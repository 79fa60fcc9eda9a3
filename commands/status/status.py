"""`bamboo-status --etcd HOST:PORT[,...] [--job NAME] [--json]`: what the jobs in an etcd
are doing, read from their keys: the current assignment (which node runs which
stage, in which zone), the standby queue, live, draining and failed nodes, the
last finished iteration and the recent iteration rate.

`--serve [HOST:]PORT` serves one job's live dashboard instead
(commands/status/dashboard.py), with --token, --price, --cross-zone-price and --refresh."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from bamboo.control.parser import OneLineParser
from bamboo.control.cluster import Cluster
from bamboo.control.credentials import ENV as TLS_ENV, ClientFiles, CredentialError
from bamboo.control.etcd import FROM_ENV, EtcdError, EtcdRefused, connect, etcd_errors, refused
from bamboo.control.protocol import CONFIG, DONE, DRAIN, ERROR, LOSS, ZONES, scan


def jobs(endpoint: str) -> list[str]:
    client = connect(endpoint)
    try:
        names = {job for job, _, _ in scan(client)}
    except etcd_errors() as e:
        if refused(e):  # a job's own credentials read that job only
            raise EtcdRefused(f"etcd at {endpoint} lets these credentials read one job only: give --job") from None
        raise EtcdError(f"etcd at {endpoint}: {type(e).__name__}") from None
    finally:
        client.close()
    return sorted(names)


def job_status(endpoint: str, job: str, tls=FROM_ENV) -> dict:
    """`tls`: the client credentials to present (default: BAMBOO_ETCD_TLS's)."""
    cluster = Cluster(endpoint, job, tls=tls)
    cfg = cluster.get(CONFIG())
    done: dict[int, dict] = {}
    for (it, node), report in cluster.children(DONE()).items():
        done.setdefault(it, {})[node] = report
    failed = cluster.failed()
    assignments = list(cluster.assignments().values())
    current = max(assignments, key=lambda a: a.epoch, default=None)

    def members(it: int) -> tuple[int, ...]:
        return max((a for a in assignments if a.start <= it), key=lambda a: a.epoch).members
    complete = [it for it, reports in done.items() if all(n in reports or n in failed for n in members(it))]
    last = max(complete, default=None)
    times = sorted(max(r.time for r in done[it].values()) for it in complete)[-11:]
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    losses = [r.value for r in cluster.children(LOSS(last)).values()] if last is not None else []
    redundancy = cfg and (current.mode(cfg.schedule.redundancy) if current else cfg.schedule.redundancy)
    sync = cfg and (cfg.schedule.epoch_sync(current) if current else cfg.schedule.replica_sync)
    status = {"job": job, "state": job_state(cfg, last, assignments), "model": cfg and cfg.model.name,
              "stages": cfg and cfg.schedule.stages, "pipelines": cfg and cfg.schedule.pipelines,
              "microbatches": cfg and cfg.schedule.microbatches,
              "iterations": cfg and cfg.schedule.iterations, "last_iteration": last,
              "loss": sum(losses) / len(losses) if losses else None,
              "iterations_per_second": round(rate, 3) if rate else None,
              "samples_per_second": round(rate * cfg.schedule.samples, 2) if rate and cfg else None,
              "alive": sorted(cluster.alive()),
              "failed": {n: failed[n].to_dict() for n in sorted(failed)},
              "zones": {n: z.zone for n, z in sorted(cluster.children(ZONES()).items())},
              "draining": sorted(cluster.children(DRAIN())),
              "errors": {n: e.message for n, e in sorted(cluster.children(ERROR()).items())},
              "epoch": current.epoch if current else None,
              "assignment": [list(p) for p in current.pipelines] if current else [],
              "standby": list(current.standby) if current else [],
              "redundancy": redundancy, "replica_sync": sync}
    if current:
        status["pipelines"] = len(current.pipelines)
    cluster.close()
    return status


def job_state(cfg, last: int | None, assignments: list) -> str:
    """unknown (no config), configured (no node has met yet), running or finished."""
    if cfg is None:
        return "unknown"
    if last is not None and last >= cfg.schedule.iterations - 1:
        return "finished"
    return "running" if assignments else "configured"


def render(status: dict) -> str:
    lines = [f"job {status['job']} ({status['state']}): {status['model']}, P={status['stages']} x "
             f"D={status['pipelines']}, iteration {status['last_iteration']} of {status['iterations']}"
             + (f", loss {status['loss']:.4f}" if status["loss"] is not None else "")
             + (f", {status['iterations_per_second']} it/s, {status['samples_per_second']} samples/s"
                if status["iterations_per_second"] else "")]
    def zone(n: int) -> str:
        return f"{n}({status['zones'][n]})" if n in status["zones"] else str(n)
    for j, pipe in enumerate(status["assignment"]):
        lines.append(f"  pipeline {j}: " + " -> ".join(f"stage {s}: node {zone(n)}" for s, n in enumerate(pipe)))
    if status["epoch"] is not None:
        lines.append(f"  epoch {status['epoch']} ({status['redundancy']} redundancy), "
                     f"standby: {' '.join(map(zone, status['standby'])) or '-'}"
                     + (f", draining: {' '.join(map(str, status['draining']))}" if status["draining"] else ""))
    lines.append(f"  alive:  {' '.join(map(str, status['alive'])) or '-'}")
    for n, f in status["failed"].items():
        lines.append(f"  failed: node {n} in iteration {f.get('iteration')} ({f.get('how', '?')[:60]})")
    return "\n".join(lines)


def prices(text: str) -> tuple[float, float | None]:
    """--price SPOT[,ONDEMAND]: dollars per node-hour."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or any(v < 0 or not math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected SPOT[,ONDEMAND], dollars per node-hour")
    return values[0], values[1] if len(values) == 2 else None


def per_gib(text: str) -> float:
    """--cross-zone-price: dollars per GiB, a finite number at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected dollars per GiB, a number at least 0")
    return value


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="bamboo-status", description=__doc__.splitlines()[0])
    ap.add_argument("--etcd", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="the jobs' etcd")
    ap.add_argument("--etcd-tls", metavar="DIR",
                    help="ca.pem, client.pem and client-key.pem for that etcd (default: $BAMBOO_ETCD_TLS)")
    ap.add_argument("--job", help="one job (default: every job in this etcd; with --serve, the only one)")
    ap.add_argument("--json", action="store_true", help="one JSON object per job")
    web = ap.add_argument_group("the live dashboard")
    web.add_argument("--serve", metavar="[HOST:]PORT",
                     help="serve the job's dashboard at http://HOST:PORT/ (host 127.0.0.1 unless given)")
    web.add_argument("--token", help="the token every request needs, 16 characters or more (default: none "
                                     "on 127.0.0.1, else one made up and printed with the URL)")
    web.add_argument("--price", type=prices, metavar="SPOT[,ONDEMAND]",
                     help="dollars per node-hour of a spot node (and an on-demand one), for the cost panel")
    web.add_argument("--cross-zone-price", type=per_gib, metavar="USD_PER_GIB",
                     help="dollars per GiB that crosses a zone (AWS and GCP: 0.01 each way), for the bytes the "
                          "cost panel counts between zones")
    web.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS",
                     help="how often the page fetches its panels again")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from commands.status.dashboard import MIN_TOKEN
    if args.token is not None and len(args.token) < MIN_TOKEN:  # "" would turn the token off
        ap.error(f"--token: {len(args.token)} characters; a token needs at least {MIN_TOKEN} "
                 "(leave it out to have one made up)")
    if args.etcd_tls is not None:
        try:
            ClientFiles.in_dir(args.etcd_tls)
        except CredentialError as e:
            ap.error(str(e))
        os.environ[TLS_ENV] = args.etcd_tls  # this process's clients (the dashboard's too) present them
    if args.serve is None and (args.token or args.price or args.refresh != 2.0 or args.cross_zone_price is not None):
        ap.error("--token, --price, --cross-zone-price and --refresh go with --serve")
    if args.serve is not None:
        from commands.status.dashboard import serve
        if not 0 < args.refresh < math.inf:
            ap.error(f"--refresh {args.refresh}: expected a finite number of seconds above 0")

        price = (*(args.price or (None, None)), args.cross_zone_price)
        return serve(args.etcd, args.job, args.serve, args.token, price, args.refresh)
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
