"""The cluster simulator's prices and costs: what `bamboo-sim` prints beside every
figure, in one frozen record that the simulator and the strategies both read."""
from __future__ import annotations

import math
from dataclasses import dataclass

from schedules.redundancy import FRC_MODES
from schedules.options import JobReplicaSync

from agents.surplus import SurplusRule
from sim.price_series import PriceSeries
from sim.profiles import NETWORK, PCIE

ROLLBACKS = ("memory", "relaunch")
ZONE_SPREADS = (PRICED, SPREAD, PACK) = ("auto", "spread", "pack")  # --zone-spread (agents/spread.py)
NOTICE_SECONDS = {"ec2": 120.0, "gcp": 30.0, "events": 0.0, "zone-counts": 0.0}  # by trace format: what each cloud announces


@dataclass(frozen=True)
class Options:
    spot_price: float = 0.918           # USD per node-hour (EC2 p3.2xlarge spot, as in the Bamboo paper)
    on_demand_price: float = 3.06       # USD per node-hour (p3.2xlarge on demand)
    checkpoint_seconds: float | None = None  # a fixed interval; None: the formula's optimum
    checkpoint_formula: str = "daly"    # or "young"
    checkpoint_bytes_per_param: float = 12.0  # fp32 master weights and AdamW's two moments
    storage_bandwidth: float = 0.5e9    # bytes/s per node to and from storage (S3 or EBS)
    snapshot_bandwidth: float = PCIE    # bytes/s accelerator -> host
    free_checkpoints: bool = False      # the old baseline: writes cost nothing
    relaunch_seconds: float = 60.0      # stop, relaunch the processes, rendezvous
    warmup_seconds: float = 30.0        # after a restart, before full speed
    restart_seconds: float | None = None  # a fixed restart cost instead of relaunch + load + warm-up
    peer_bandwidth: float = NETWORK     # bytes/s of a stage reloaded from a data-parallel peer
    reconfigure_seconds: float = 10.0   # agents' decision and new process groups
    failure_timeout: float = 3.0        # seconds before a silent node counts as dead
    zones: tuple[str, ...] = ("a", "b", "c")  # for traces without zones: nodes dealt in turn
    startup_seconds: float = 0.0        # from a node's arrival to its being usable (0: the trace says when)
    max_stages: int = 2                 # stages one node may hold: above 1, pipelines shorter than P use every node
    notice_seconds: float = 0.0         # a preemption is announced this long ahead (EC2 120 s, GCP 30 s)
    rollback: str = "memory"            # a stage lost everywhere: from the checkpoint copies in peers' memory,
                                        # or "relaunch" (every process restarts and reads storage)
    frc: str = "bubbles"                # eager: FRC only where it fits the bubbles, or for every microbatch (all)
    acquire_seconds: float = 300.0      # a replacement's wait: the request, boot and join (docs/simulator.md)
    standby_epsilon: float = 0.01       # the burst rule's chance of losing more than the standby in that wait
    surplus: str = "burst"              # the nodes beyond the pipelines: agents/surplus.py's SurplusRule
    fixed_standby: int = 2              # --surplus fixed: the standby kept (SpotHedge's over-provisioning)
    price_series: PriceSeries | None = None  # the spot price over time (--price-series), instead of spot_price
    replica_sync: str = "auto"          # eager and lazy: each replica's sync at the iteration's end, or in the next
                                        # one (its window charged: sim/windows.py), or chosen (auto: sim/auto.py)
    zone_spread: str = "auto"           # neighbours in different zones (spread), pipelines packed in zones (pack),
                                        # or whichever costs less (auto: agents/spread.py)
    cross_zone_price: float = 0.0       # USD per GiB between zones: what auto weighs (0: spreading is free)
    zone_bytes: tuple[tuple[str, float], ...] = ()  # the job's bytes per iteration by kind (sim/pricing.py)

    def check(self) -> None:
        """Raise ValueError naming the first option that cannot be used."""
        for name in ("spot_price", "on_demand_price", "storage_bandwidth", "snapshot_bandwidth",
                     "peer_bandwidth", "checkpoint_bytes_per_param"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive (got {getattr(self, name)})")
        for name in ("relaunch_seconds", "warmup_seconds", "reconfigure_seconds", "failure_timeout",
                     "startup_seconds", "acquire_seconds"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, not negative "
                                 f"(got {getattr(self, name)})")
        if not 1 <= self.max_stages <= 2:
            raise ValueError(f"--max-stages-per-node must be 1 or 2 (got {self.max_stages}): the compiler merges "
                             "one stage into its predecessor, no more")
        if not self.notice_seconds >= 0:
            raise ValueError(f"--notice-seconds must not be negative (got {self.notice_seconds})")
        if not 0 < self.standby_epsilon < 1:
            raise ValueError(f"--standby-epsilon must be above 0 and below 1 (got {self.standby_epsilon})")
        if self.surplus not in tuple(SurplusRule):
            raise ValueError(f"--surplus must be one of {', '.join(SurplusRule)} (got {self.surplus!r})")
        if not self.fixed_standby >= 0:
            raise ValueError(f"--fixed-standby must not be negative (got {self.fixed_standby})")
        if self.frc not in FRC_MODES:
            raise ValueError(f"--frc must be one of {', '.join(FRC_MODES)} (got {self.frc!r})")
        if self.replica_sync not in JobReplicaSync.values():
            raise ValueError(f"--replica-sync must be one of {', '.join(JobReplicaSync.values())} "
                             f"(got {self.replica_sync!r})")
        if self.zone_spread not in ZONE_SPREADS:
            raise ValueError(f"--zone-spread must be one of {', '.join(ZONE_SPREADS)} (got {self.zone_spread!r})")
        if not 0 <= self.cross_zone_price < 1e6:
            raise ValueError(f"--cross-zone-price must be from 0 up (got {self.cross_zone_price})")
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"--rollback must be one of {', '.join(ROLLBACKS)} (got {self.rollback!r})")
        if self.checkpoint_seconds is not None and not self.checkpoint_seconds > 0:
            raise ValueError(f"the checkpoint interval must be positive (got {self.checkpoint_seconds} s)")
        if self.restart_seconds is not None and not self.restart_seconds >= 0:
            raise ValueError(f"--restart-seconds must not be negative (got {self.restart_seconds})")
