"""Write a generated spot trace in the `events` format (traces/README.md): Poisson
preemptions per running node, a share of them taking a whole zone at once,
replacements after an exponential delay, and, with --outage-every, the whole fleet
gone for --outage-hours at a time, back in one burst. The same arguments give the
same file.

    python scripts/make_trace.py OUT [--hours 24] [--nodes 36] [--zones a,b,c] [--rate 0.3]
        [--bulk 0.5] [--refill-seconds 300] [--outage-every 4] [--outage-hours 1] [--seed 1]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sim.traces import synthetic, with_outages, write_events  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"make_trace: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the CSV to write (temp file, then rename)")
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--nodes", type=int, default=36, help="nodes the group asks for")
    p.add_argument("--zones", default="a,b,c")
    p.add_argument("--rate", type=float, default=0.3, help="preemptions per node-hour")
    p.add_argument("--bulk", type=float, default=0.5, help="share of preemptions that take a whole zone")
    p.add_argument("--refill-seconds", type=float, default=300.0, help="mean delay of a replacement")
    p.add_argument("--outage-every", type=float, default=0.0, help="hours between fleet-wide outages (0: none)")
    p.add_argument("--outage-hours", type=float, default=1.0, help="how long each outage lasts")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    zones = tuple(z.strip() for z in a.zones.split(",") if z.strip())
    checks = [(a.hours > 0, "--hours must be positive"), (a.nodes >= 1, "--nodes must be at least 1"),
              (bool(zones), "--zones names no zone"), (a.rate >= 0, "--rate must not be negative"),
              (0 <= a.bulk <= 1, "--bulk must be between 0 and 1"),
              (a.refill_seconds >= 0, "--refill-seconds must not be negative"),
              (a.outage_every >= 0, "--outage-every must not be negative"),
              (a.outage_hours > 0, "--outage-hours must be positive"),
              (not a.outage_every or a.outage_hours < a.outage_every,
               "--outage-hours must be shorter than --outage-every")]
    for ok, why in checks:
        if not ok:
            p.error(why)
    events = synthetic(a.hours, a.nodes, zones, a.rate, a.seed, bulk=a.bulk, refill_seconds=a.refill_seconds)
    events = with_outages(events, a.outage_every * 3600, a.outage_hours * 3600, until=a.hours * 3600)
    try:
        write_events(events, a.out)
    except OSError as e:
        p.error(f"{a.out}: {e.strerror}")
    print(f"{a.out}: {len(events)} events, {a.nodes} nodes in zones {','.join(zones)}, {a.hours:g} h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
