"""Bursts for bamboo-chaos: spot capacity leaves together, often a whole zone within
minutes, often while a recovery is still running.

`burst` kills k nodes within one second: k drawn from 2 to the nodes of a zone (or,
with machines of several nodes, whole machines of one zone), topped up from other
zones when the zone has fewer. Half the time it arms a second burst for when the job
starts recovering from the first (a failover's cut, a redo's abort or the next epoch
in etcd).
`phase-burst` arms a burst for when the job next enters a phase, seen in etcd: a
handover, a failover's cut, a redo, a checkpoint, a regroup. An armed burst whose
phase does not come within PATIENCE seconds goes off anyway (its detail says so).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from bamboo.control.etcd import etcd_errors
from bamboo.control.protocol import ABORT, ASSIGNMENT, CHECKPOINTED, CUT, HANDED, REGROUP, scan

BURST_KINDS = ("burst", "phase-burst")
# a phase: the key families whose new key says the job entered it
PHASES = {"handover": (HANDED,), "cut": (CUT,), "redo": (ABORT,), "checkpoint": (CHECKPOINTED,),
          "regroup": (REGROUP,), "recovery": (CUT, ABORT, ASSIGNMENT)}
SPREAD = 1.0      # seconds: a burst's kills land within this
PATIENCE = 20.0   # seconds an armed burst waits for its phase
LOOK_EVERY = 0.1  # seconds between two reads of etcd while a burst is armed


@dataclass
class Armed:
    phase: str
    seen: frozenset | None  # the phase's keys when it was armed (None: etcd did not answer yet)
    deadline: float
    label: str              # how the fault's detail names it when it goes off


class Bursts:
    """Mixed into commands/chaos/trial.py's Trial: uses its rng, settings,
    outcome, processes and kills."""

    def _init_bursts(self) -> None:
        self.armed: list[Armed] = []
        self.looked = 0.0

    def _burst(self) -> str:
        second = self.rng.random() < 0.5
        seen = self._keys("recovery") if second else None  # before the kills: their recovery is the trigger
        detail = self._kill_burst()
        if second:
            self.armed.append(Armed("recovery", seen, time.monotonic() + PATIENCE, "second burst"))
            detail += "; a second armed for its recovery"
        return detail

    def _phase_burst(self) -> str:
        phase = self.rng.choice(sorted(set(PHASES) - {"recovery"}))
        self._arm(phase, f"burst on {phase}")
        return f"armed on {phase}"

    def _arm(self, phase: str, label: str) -> None:
        self.armed.append(Armed(phase, self._keys(phase), time.monotonic() + PATIENCE, label))

    def _fire_armed(self) -> None:
        """Set off each armed burst whose phase has come (or whose patience ran out)."""
        now = time.monotonic()
        if not self.armed or now - self.looked < LOOK_EVERY:
            return
        self.looked = now
        for armed in list(self.armed):
            keys = self._keys(armed.phase)
            if armed.seen is None:  # the first answer is the baseline
                armed.seen = keys
                continue
            came = keys is not None and bool(keys - armed.seen)
            if came or now >= armed.deadline:
                self.armed.remove(armed)
                why = "" if came else f" ({armed.phase} not reached in {PATIENCE:.0f} s)"
                kind = "burst" if armed.label == "second burst" else "phase-burst"  # counted as its kind
                self.outcome.faults.append((round(now - self.t0, 2), kind,
                                            f"{armed.label}: {self._kill_burst()}{why}"))

    def _keys(self, phase: str) -> frozenset | None:
        """The keys of `phase`'s families in the trial's etcd (None: etcd did not answer)."""
        families = PHASES[phase]
        try:
            return frozenset((f.name, parts) for _, f, parts in scan(self.client) if f in families)
        except etcd_errors():
            return None

    def _kill_burst(self) -> str:
        """k nodes (or machines) of one zone, and of others when it has too few, each
        SIGKILLed at its own moment within SPREAD seconds."""
        zone = self.rng.choice(self.settings.zones)
        pool = [p for p in self._burst_pool() if p.is_running()]
        if len(pool) < (2 if self.settings.per_host == 1 else 1):
            return f"zone {zone}: too few {'nodes' if self.settings.per_host == 1 else 'machines'} left for a burst"
        here = [p for p in pool if self._zone_of(p) == zone]
        least = 1 if self.settings.per_host > 1 else 2
        k = self.rng.randint(least, max(least, len(here)))
        others = [p for p in pool if p not in here]
        victims = here[:] if len(here) <= k else self.rng.sample(here, k)
        victims += self.rng.sample(others, min(len(others), k - len(victims)))
        offsets = sorted(self.rng.uniform(0, SPREAD) for _ in victims)
        began, named = time.monotonic(), []
        for victim, offset in zip(victims, offsets):
            time.sleep(max(0.0, began + offset - time.monotonic()))  # the burst's own timing
            named.append(self._kill_host_process(victim) if self.settings.per_host > 1 else
                         self._kill(victim, with_worker=True))
        return f"zone {zone}: {len(victims)} {'machines' if self.settings.per_host > 1 else 'nodes'} " \
               f"in {time.monotonic() - began:.2f} s ({'; '.join(named)})"

    def _burst_pool(self) -> list:
        """What a burst kills: machines with several nodes each, else nodes' agents."""
        if self.settings.per_host > 1:
            return [p for p in self._job_processes() if self._machine(p)]
        return self._agents()
