"""Which draft source ("arm") drafts for which request: SPIN's learning-based selection (LBSS,
`bandit.py`) and the two baselines of SPIN's figure 11 (greedy by prompt length, epsilon-greedy),
behind one interface the router uses: `arm_for`, `observe`, `release` (docs/router.md).

Arms are the drafter service's models (by name) and the lookup datastore ("datastore"). Time is
cut into SPIN's slots of `slot_s` seconds; a new slot's first step re-plans every live request.
Departures from SPIN, each explained in docs/decisions/drafter-selection.md:
- a step's feedback is tokens emitted per second, the bonus token counted (SPIN: accepted);
- epsilon-greedy exploits with probability epsilon, as SPIN words it (`exploit_probability`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from specmesh_services.router.bandit import LBSS, DrafterSpec


@dataclass(frozen=True)
class Arm:
    """A draft source the selection can give a request: a model drafter or the datastore."""

    name: str
    capacity: int = 8  # requests it drafts for at once (SPIN's B_j)
    switch_cost_per_token_s: float = 0.0  # prefill time per context token of a request moving here


class Selection:
    """Common part: the slot clock, the per-slot plan over the live requests, feedback."""

    def __init__(self, arms: list[Arm], slot_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not arms:
            raise ValueError("a selection needs at least one arm")
        self.arms = list(arms)
        self.names = [a.name for a in arms]
        self.slot_s = slot_s
        self._clock = clock
        self._slot_started = clock()
        self._plan: dict[str, str | None] = {}

    def arm_for(self, request_id: str, live: Mapping[str, int],
                idle: Callable[[str, str], bool] | None = None,
                contexts: Callable[[], Mapping[str, int]] | None = None) -> str | None:
        """The arm of `request_id` this slot; `live` maps every live request to its prompt length,
        `contexts()` to its context (prompt + generated: what prefilling it on another drafter
        costs; default `live`), asked only when the slot's plan is made. None: no arm has room (the step runs without a tree). `idle(request, arm)`: the request
        would decode plainly on that arm (its tree-size policy says no tree pays there); LBSS
        does not explore such arms, the baselines ignore it (SPIN's definitions)."""
        now = self._clock()
        if now - self._slot_started >= self.slot_s:
            self._slot_started = now
            self._next_slot()
            self._plan = {}
        if request_id not in self._plan:
            self._plan.update(self._assign(dict(live), idle,
                                           dict(contexts() if contexts else live)))
        return self._plan.get(request_id)

    def likely_arm(self, request_id: str) -> str | None:
        """Where the request will probably draft next (fast switching: prefill it there early)."""
        return self._plan.get(request_id)

    def next_arms(self, request_id: str) -> set[str]:
        """The arms the request's next step may draft on: this slot's (a step is far shorter
        than a slot) and, should the slot end first, the next one's (`likely_arm`)."""
        return {a for a in (self._plan.get(request_id), self.likely_arm(request_id)) if a}

    def observe(self, request_id: str, arm: str, tokens: int, seconds: float) -> None:
        pass

    def release(self, request_id: str) -> None:
        self._plan.pop(request_id, None)

    def _next_slot(self) -> None:
        pass

    def _assign(self, live: dict[str, int], idle: Callable[[str, str], bool] | None = None,
                contexts: dict[str, int] | None = None) -> dict[str, str | None]:
        raise NotImplementedError


class LBSSSelection(Selection):
    """SPIN's LBSS: exploration chunks, then max-weight matching under capacities."""

    def __init__(self, arms: list[Arm], slot_s: float = 1.0, seed: int = 0, **kw) -> None:
        super().__init__(arms, slot_s, **kw)
        self.lbss = LBSS([DrafterSpec(a.name, 1, a.capacity,
                                      switch_cost_per_token_s=a.switch_cost_per_token_s)
                          for a in arms], seed=seed)

    def _assign(self, live: dict[str, int], idle: Callable[[str, str], bool] | None = None,
                contexts: dict[str, int] | None = None) -> dict[str, str | None]:
        placed = self.lbss.assign(list(live), contexts or live, idle)
        return {rid: p.drafter if p is not None else None for rid, p in placed.items()}

    def likely_arm(self, request_id: str) -> str | None:
        p = self.lbss.likely_destination(request_id)
        return p.drafter if p is not None else None

    def observe(self, request_id: str, arm: str, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.lbss.observe(request_id, arm, tokens, seconds)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.lbss.release(request_id)

    def _next_slot(self) -> None:
        self.lbss.next_slot()


class _Goodputs:
    """Mean observed goodput per arm."""

    def __init__(self, names: list[str]) -> None:
        self.sums = dict.fromkeys(names, 0.0)
        self.counts = dict.fromkeys(names, 0)

    def add(self, arm: str, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.sums[arm] += tokens / seconds
            self.counts[arm] += 1

    def best(self) -> str | None:
        seen = [a for a in self.sums if self.counts[a]]
        return max(seen, key=lambda a: self.sums[a] / self.counts[a]) if seen else None


def _fill(order: list[str], wanted: list[str], arms: list[Arm]) -> dict[str, str | None]:
    """Places requests (in `order`) on their wanted arm, else any arm with room, else None."""
    load = dict.fromkeys((a.name for a in arms), 0)
    capacity = {a.name: a.capacity for a in arms}
    out: dict[str, str | None] = {}
    for rid, want in zip(order, wanted):
        if load[want] >= capacity[want]:
            free = [a for a in load if load[a] < capacity[a]]
            want = free[0] if free else None
        if want is not None:
            load[want] += 1
        out[rid] = want
    return out


class GreedyByPromptLength(Selection):
    """Shorter prompts on cheaper arms (arms listed cheapest first), in equal shares."""

    def _assign(self, live: dict[str, int], idle: Callable[[str, str], bool] | None = None,
                contexts: dict[str, int] | None = None) -> dict[str, str | None]:
        order = sorted(live, key=lambda rid: (live[rid], rid))
        m, n = len(self.arms), len(order)
        wanted = [self.names[min(i * m // max(n, 1), m - 1)] for i in range(n)]
        return _fill(order, wanted, self.arms)


class EpsilonGreedy(Selection):
    """Per slot: with `exploit_probability` every request takes the best arm so far, otherwise
    each draws one at random (SPIN: exploit_probability = epsilon = 0.2)."""

    def __init__(self, arms: list[Arm], slot_s: float = 1.0, exploit_probability: float = 0.2,
                 seed: int = 0, **kw) -> None:
        super().__init__(arms, slot_s, **kw)
        if not 0 <= exploit_probability <= 1:
            raise ValueError("exploit_probability must be in [0, 1]")
        self.exploit_probability = exploit_probability
        self.goodputs = _Goodputs(self.names)
        self._rng = np.random.default_rng(seed)
        self._exploit = self._draw_mode()

    def _draw_mode(self) -> bool:
        return bool(self._rng.random() < self.exploit_probability)

    def _next_slot(self) -> None:
        self._exploit = self._draw_mode()

    def _assign(self, live: dict[str, int], idle: Callable[[str, str], bool] | None = None,
                contexts: dict[str, int] | None = None) -> dict[str, str | None]:
        order = list(live)
        best = self.goodputs.best() if self._exploit else None
        wanted = [best or self.names[self._rng.integers(len(self.names))] for _ in order]
        return _fill(order, wanted, self.arms)

    def observe(self, request_id: str, arm: str, tokens: int, seconds: float) -> None:
        self.goodputs.add(arm, tokens, seconds)


def make_selection(kind: str, arms: list[Arm], slot_s: float = 1.0, seed: int = 0,
                   epsilon: float = 0.2) -> Selection:
    if kind == "lbss":
        return LBSSSelection(arms, slot_s, seed)
    if kind == "greedy":
        return GreedyByPromptLength(arms, slot_s)
    if kind == "epsilon-greedy":
        return EpsilonGreedy(arms, slot_s, epsilon, seed)
    raise ValueError(f"unknown drafter selection {kind!r}: lbss, greedy or epsilon-greedy")
