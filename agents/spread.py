"""Zone spread as a priced choice: whether a job's pipelines keep neighbouring
stages in different zones (a burst that takes a zone then takes no node with the
node that holds its replica, so the replicas cover it) or pack each pipeline in
as few zones as it can (nothing but the data-parallel reduce crosses a zone).

Spreading costs bytes: every stage boundary's activations and input gradients,
and every replica sync, cross a zone, at the cloud's price per GiB (EC2 $0.02).
For a billion-parameter model that is hundreds of dollars an hour against a few
for the nodes (docs/cost.md). Packing costs bursts: a burst that takes a zone's
nodes takes neighbours together, so the iteration is redone from a peer pipeline
(or, with one pipeline, rolled back) instead of failed over. `pack_zones` weighs
the one against the other per hour: the simulator's `--zone-spread auto` calls it
at every reconfiguration. The agents take the placement as `bamboo-train
--zone-spread spread|pack`; weighing it at run time, from the workers' measured
bytes, is not built yet.
"""
from __future__ import annotations

from agents.surplus import BurstModel

GIB = 2 ** 30


def zone_bursts_per_hour(bursts: BurstModel, window: float) -> float:
    """Bursts an hour that take more than one node at once: those a spread placement
    survives inside the iteration and a packed one may not."""
    sizes = bursts.size_distribution()
    return bursts.rate(window) * 3600 * sum(sizes[2:])


def pack_zones(saved_bytes_per_hour: float, price_per_gib: float, zone_bursts: float,
               lost_node_seconds: float, node_price: float) -> bool:
    """Whether packing pipelines in zones pays: the bytes between zones it saves an
    hour at `price_per_gib`, against the `zone_bursts` an hour times the node-seconds
    each costs more packed (`lost_node_seconds`: the pause's difference times the
    nodes it holds) at `node_price` a node-hour. With no price, spreading is free."""
    saved = saved_bytes_per_hour / GIB * price_per_gib
    lost = zone_bursts * lost_node_seconds / 3600 * node_price
    return saved > lost
