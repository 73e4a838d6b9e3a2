"""`specmesh up`'s watch over its children: a process that dies is started again on the same
ports, after a delay that doubles with each death in a row (1 s up to 30 s, as Kubernetes'
restart policy backs off), while the rest of the mesh carries on; why it died (its exit code and
the end of its log) is printed first. A child that has served for a minute starts again from
the shortest delay.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
HEALTHY_RESET_S = 60.0  # served this long: its next death starts from FIRST_DELAY_S


@dataclass
class Backoff:
    """Per role: how long to wait before the next restart."""

    delays: dict[str, float] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def next(self, role: str, served_s: float) -> float:
        previous = self.delays.get(role)
        delay = FIRST_DELAY_S if previous is None or served_s >= HEALTHY_RESET_S \
            else min(previous * 2, MAX_DELAY_S)
        self.delays[role] = delay
        self.restarts[role] = self.restarts.get(role, 0) + 1
        return delay


def supervise(stack, stopping: list, on_change: Callable[[], None]) -> None:
    """Watches `stack`'s children until `stopping` is set, restarting any that dies;
    `on_change` is called after each restart (the state file names the new pid)."""
    backoff = Backoff()
    while not stopping:
        dead = stack.dead_child()
        if dead is None:
            time.sleep(0.5)
            continue
        time.sleep(0.5)  # a signal to the whole group may reach this process last
        if stopping:
            return
        delay = backoff.next(dead.name, time.monotonic() - dead.started)
        print(f"{dead.name} died (code {dead.process.returncode}); restart "
              f"{backoff.restarts[dead.name]} in {delay:.0f} s. Its log ended with:\n"
              f"{dead.log_tail()}", file=sys.stderr, flush=True)
        if not _sleep(delay, stopping):
            return
        try:
            child = stack.restart(dead, stopping)
        except RuntimeError as err:  # it died again while starting: the next turn backs off
            print(f"{dead.name} did not come back: {err}", file=sys.stderr, flush=True)
            continue
        print(f"{child.name} restarted (pid {child.process.pid})", flush=True)
        on_change()


def _sleep(seconds: float, stopping: list) -> bool:
    """Sleeps unless asked to stop; False when asked."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if stopping:
            return False
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
    return not stopping
