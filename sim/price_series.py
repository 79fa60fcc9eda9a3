"""A spot price that moves: USD per node-hour every G seconds, as a cloud's price
history gives it, so that a run pays for each node-second at the price of its
time rather than at one `--spot-price`.

    {"metadata": {"gap_seconds": G}, "data": [price, ...]}

Price k holds over [k G, (k + 1) G); the last one holds to the end of the trace.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from sim.traces import MAX_FILE_BYTES, SPAN_MAX, TraceError

SHAPE = '{"metadata": {"gap_seconds": G}, "data": [price, ...]}'
PRICES_MAX = 1_000_000     # samples: a price every 5 minutes for nine years
PRICE_MAX = 10_000.0       # USD per node-hour: far above any instance's on-demand price


@dataclass(frozen=True)
class PriceSeries:
    gap: float                  # seconds between prices
    prices: tuple[float, ...]   # USD per node-hour

    def cost(self, start: float, end: float) -> float:
        """USD of one node held from `start` to `end` (seconds)."""
        total, t = 0.0, start
        while t < end:
            k = min(int(t // self.gap), len(self.prices) - 1)
            until = end if k == len(self.prices) - 1 else min(end, (k + 1) * self.gap)
            total += self.prices[k] * (until - t) / 3600
            t = until
        return total

    def paid(self, timeline: list[tuple[float, int, float]], horizon: float) -> float:
        """USD of a run's nodes: `timeline` gives (from when, nodes held, rate), each
        entry holding until the next one, the last until `horizon`."""
        ends = [t for t, _, _ in timeline[1:]] + [horizon]
        return sum(nodes * self.cost(t, max(t, end)) for (t, nodes, _), end in zip(timeline, ends))

    def per_hour(self, timeline: list[tuple[float, int, float]], horizon: float) -> float:
        """USD per hour of a run's nodes over `horizon` seconds (`paid`, averaged)."""
        return self.paid(timeline, horizon) / (horizon / 3600) if horizon else 0.0

    def describe(self) -> dict:
        mean = sum(self.prices) / len(self.prices)
        return {"gap_seconds": self.gap, "samples": len(self.prices), "mean": round(mean, 4),
                "min": min(self.prices), "max": max(self.prices)}


def read_prices(path: str) -> PriceSeries:
    """The series in `path`; TraceError naming the file and the first bad value."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise TraceError(f"{path}: cannot read the price series ({e.strerror or e})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise TraceError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        doc = json.loads(raw.decode())
        gap, data = doc["metadata"]["gap_seconds"], doc["data"]
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except (KeyError, TypeError, UnicodeDecodeError, ValueError, RecursionError):
        raise TraceError(f"{path}: expected {SHAPE}") from None
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 < gap < SPAN_MAX:
        raise TraceError(f"{path}: gap_seconds must be a positive number of seconds (got {gap!r})")
    if not isinstance(data, list) or not 0 < len(data) <= PRICES_MAX:
        raise TraceError(f"{path}: data must be a list of 1 to {PRICES_MAX} prices")
    for k, price in enumerate(data):
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not math.isfinite(price) \
                or not 0 < price <= PRICE_MAX:
            raise TraceError(f"{path}: price {k} must be above 0 and at most {PRICE_MAX:g} USD per node-hour "
                             f"(got {price!r})")
    return PriceSeries(float(gap), tuple(float(p) for p in data))


def series_from(path: str | None, spot_price_given: bool) -> PriceSeries | None:
    """--price-series PATH's series (None without it); with --spot-price too, refused."""
    if not path:
        return None
    if spot_price_given:
        raise ValueError("--price-series gives the spot price: leave out --spot-price")
    return read_prices(path)
