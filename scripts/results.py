"""What the benchmark and simulator scripts share: writing their results file
whole or not at all (a temp file beside it, then a rename)."""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile


def write_json(path: str, data) -> None:
    """`data` as indented JSON at `path`: a reader sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".json", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_target(ap, flag: str, path: str | None) -> None:
    """Refuse (through argparse's error: status 2) a results file that could not be
    written, before any work is done."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        ap.error(f"{flag} {path!r}: cannot write a file there")


def whole_numbers(ap, flag: str, text: str, least: int) -> list[int]:
    """`A-B` (a range) or `A,B,...` as integers, each at least `least`, or argparse's error."""
    try:
        low, dash, high = text.partition("-")
        values = list(range(int(low), int(high) + 1)) if dash else [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: expected whole numbers A-B or A,B,...")
    if not values or min(values) < least:
        ap.error(f"{flag} {text!r}: expected at least one value, each at least {least}")
    return values


def at_least(ap, bounds) -> None:
    """argparse's error for the first (flag, value, least) whose value is below its least."""
    for flag, value, least in bounds:
        if value < least:
            ap.error(f"{flag} must be at least {least} (got {value})")


T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95% confidence interval (t over the
    logs, df = rounds - 1): whether a ratio's distance from 1 is more than the noise."""
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.mean(logs), 0.0
    if len(logs) > 1:
        half = T975[min(len(logs) - 2, len(T975) - 1)] * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
