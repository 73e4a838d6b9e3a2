"""Which cores each compute role runs on.

shared: every role sees all of this machine's cores; the verifier's OpenMP team takes them all,
the drafter's half, and the two take turns on them. split: the verifier and the drafting roles
(draft models, datastore) get disjoint sets, so a drafter drafts (ahead, or for other requests)
while the verifier verifies instead of waiting for the cores. A compute thread is pinned with
sched_setaffinity before its first parallel op: OpenMP creates its team from the pinning thread,
so the team inherits the set, and torch's thread count is set per thread.
"""
from __future__ import annotations

import os
from concurrent.futures import Executor
from dataclasses import dataclass

DRAFTING_ROLES = ("drafter", "datastore")


@dataclass(frozen=True)
class CorePlan:
    """The cores of each compute role; `split` False: every role may use all of them."""

    split: bool
    verifier: frozenset[int]
    drafting: frozenset[int]

    def cpus(self, role: str) -> frozenset[int]:
        return self.drafting if role in DRAFTING_ROLES else self.verifier

    def threads(self, role: str) -> int:
        """Torch threads of a role. Shared: the verifier (the critical path) gets every core,
        the drafter half, the others one. Uncapped, the drafter's and the verifier's OpenMP
        teams oversubscribe the cores and spin at barriers: 4 requests in flight ran at 5.8
        tok/s instead of 12.5 (bf16 SmolLM2, 2 cores)."""
        if self.split and role in ("verifier", *DRAFTING_ROLES):
            return len(self.cpus(role))
        return {"verifier": len(self.verifier),
                "drafter": max(1, len(self.verifier) // 2)}.get(role, 1)


def resolve_mode(mode: str, cores: int) -> str:
    """"auto": the faster placement measured for this host kind (docs/decisions/core-placement.md);
    a single core can only be shared."""
    if cores < 2:
        return "shared"
    return "shared" if mode == "auto" else mode


def plan(mode: str, drafter_cores: int = 0, available: set[int] | None = None) -> CorePlan:
    """Cores from `available` (default: this process's affinity). Split: the drafting roles get
    the last `drafter_cores` (0 = a third, at least one), the verifier the rest."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    every = frozenset(cpus)
    if resolve_mode(mode, len(cpus)) == "shared":
        return CorePlan(False, every, every)
    take = drafter_cores or max(1, len(cpus) // 3)
    if not 0 < take < len(cpus):
        raise ValueError(f"drafter_cores={drafter_cores} leaves no core to the verifier or the "
                         f"drafter on {len(cpus)} cores")
    return CorePlan(True, frozenset(cpus[:-take]), frozenset(cpus[-take:]))


def pin_current_thread(cpus: frozenset[int], threads: int) -> tuple[frozenset[int], int]:
    """Runs the calling thread (and the OpenMP team it creates) on `cpus` with `threads` torch
    threads; returns what it ran on before. Call on the compute thread before its model work."""
    import torch

    before = frozenset(os.sched_getaffinity(0)), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)  # 0: the calling thread
    torch.set_num_threads(threads)
    return before


def pin_executor(executor: Executor, cpus: frozenset[int], threads: int
                 ) -> tuple[frozenset[int], int]:
    """Pins the single thread of a compute executor; returns its cores and threads before."""
    return executor.submit(pin_current_thread, cpus, threads).result()
