"""How long each process the launcher started ran, seen from outside it: the local
cluster's paid node-seconds, against which the dashboard's ledger is checked.

A thread per process waits for its exit without reaping it (waitid with WNOWAIT),
so the launcher's own Popen still collects its status, and the exit is timed the
moment it happens rather than at the launcher's next look.
"""
from __future__ import annotations

import os
import threading
import time


class ProcessClock:
    def __init__(self):
        self.spans: dict[str, list[list[float | None]]] = {}  # name -> [start, end or None] of each process
        self._lock = threading.Lock()

    def started(self, name: str, pid: int) -> None:
        """Time `pid` (named `name`; a name may run again) from now to its exit."""
        span: list[float | None] = [time.time(), None]
        with self._lock:
            self.spans.setdefault(name, []).append(span)
        threading.Thread(target=self._wait, args=(pid, span), daemon=True, name=f"clock-{name}").start()

    @staticmethod
    def _wait(pid: int, span: list) -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # reaped already by the launcher (or not its child): it has exited
        span[1] = time.time()

    def seconds(self) -> dict[str, float]:
        """Seconds each name's processes ran (a process still running: until now)."""
        now = time.time()
        with self._lock:
            return {name: round(sum((end or now) - start for start, end in spans), 3)
                    for name, spans in self.spans.items()}
