"""Learning-based SSM selection (LBSS) of SPIN (section IV): which drafter serves which request,
a multi-armed bandit whose reward is goodput (target-accepted tokens per second). Epochs of
`alpha` exploration slots (chunks of `beta` slots, each request on a random drafter, at most B_j
per drafter), then 2^k exploitation slots on a max-weight matching of requests to drafter slots
(Kuhn-Munkres); `likely_destination` says where a request goes next, to prefill it there early.
The router's selection (`selection.py`) calls `assign` per slot, `observe` per result and
`next_slot`. Plain Python + numpy + scipy. Deviations, numbered as in
docs/decisions/drafter-selection.md and marked `deviation:` where coded:
1. a drafter has `replicas` instances of `capacity` requests each (B_j = their product).
2. requests dropped in exploration are re-placed on a drafter with room (`refill`).
3. the exploitation matching charges the switching cost (eq. 6; `switch_weight`).
4. estimates average every observation behind the drafter's pooled mean (`prior_weight`).
5. requests come and go: placed in free capacity; placed on a prior, re-matched next slot.
6. more requests than capacity: the overflow gets None (plain decoding).
7. exploitation predicts a destination by the matching, not argmax_j g~[i, j].
8. exploration skips drafters on which the request would decode plainly (`idle`).
9. exploration retires drafters that never paid on any request (`retire_after`).
10. goodput is a ratio of sums (tokens over seconds), not a mean of per-step ratios.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

# A stay beats a switch of equal weight (ties broken towards no prefill).
_STAY_BONUS = 1e-9


def _rates(stats: np.ndarray, unseen: float = 0.0) -> np.ndarray:
    """Goodput per drafter of a [3, M] (tokens, seconds, observations) table; `unseen` where
    nothing was observed."""
    tokens, seconds, n = stats
    return np.divide(tokens, seconds, out=np.full(len(tokens), unseen, dtype=float),
                     where=n > 0)


def _with_request(served: np.ndarray, best: np.ndarray, stats: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(requests served, best request goodput) per drafter, counting one more request's
    [3, M] table on the drafters it was observed on (deviation 9)."""
    seen = stats[2] > 0
    return served + seen, np.where(seen, np.maximum(best, _rates(stats)), best)


@dataclass(frozen=True)
class DrafterSpec:
    """One kind of drafter (an arm): `replicas` instances, each batching `capacity` requests."""

    name: str
    replicas: int = 1
    capacity: int = 1                      # B_j per instance: requests drafted at once
    switch_cost_s: float = 0.0             # prefill time of a request moving here, fixed part
    switch_cost_per_token_s: float = 0.0   # ... plus this per token of its context

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a drafter needs a name")
        if self.replicas < 1 or self.capacity < 1:
            raise ValueError(f"drafter {self.name!r}: replicas and capacity must be >= 1, "
                             f"got replicas={self.replicas}, capacity={self.capacity}")
        if self.switch_cost_s < 0 or self.switch_cost_per_token_s < 0:
            raise ValueError(f"drafter {self.name!r}: switching costs must be >= 0")


class Placement(NamedTuple):
    """Where a request drafts in a slot: a drafter and one of its instances."""

    drafter: str
    replica: int


@dataclass(frozen=True)
class Estimate:
    """Estimated goodput (accepted tokens / s) of one request on one drafter."""

    goodput: float   # mean of the observations; the drafter's overall mean when count == 0
    count: int       # observations behind it


PlanKey = tuple[int, int | str]   # (epoch, chunk index) or (epoch, "exploit")


class LBSS:
    """Algorithm 1 of SPIN over heterogeneous drafters with batch capacities."""

    def __init__(self, drafters: Iterable[DrafterSpec], alpha: int = 4, beta: int = 2,
                 seed: int = 0, *, switch_weight: float = 1.0, slot_s: float | None = None,
                 refill: bool = True, retire_after: int = 3,
                 prior_weight: float = 2.0) -> None:
        """`alpha`: exploration slots per epoch, `beta`: chunk size (divides alpha),
        `switch_weight`: lambda of (6), `slot_s`: slot duration for the switching cost (None =
        mean observed seconds), `refill`: re-place requests dropped in exploration,
        `retire_after`: requests a drafter must have served before exploration may leave it
        out for never having paid (deviation 9; 0 = never), `prior_weight`: observations the
        drafter's pooled mean counts as in each request's estimate (deviation 4)."""
        self.drafters = tuple(drafters)
        if not self.drafters:
            raise ValueError("LBSS needs at least one drafter")
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate drafter names: {names}")
        if beta < 1 or alpha < beta or alpha % beta:
            raise ValueError(f"need 1 <= beta <= alpha and beta dividing alpha, "
                             f"got alpha={alpha}, beta={beta}")
        if switch_weight < 0 or (slot_s is not None and not slot_s > 0):
            raise ValueError("switch_weight must be >= 0 and slot_s > 0")
        if retire_after < 0 or prior_weight < 0:
            raise ValueError(f"retire_after and prior_weight must be >= 0, got {retire_after} "
                             f"and {prior_weight}")
        self.prior_weight = prior_weight
        self.alpha, self.beta, self.switch_weight = alpha, beta, switch_weight
        self.retire_after = retire_after
        self.slot_s, self.refill = slot_s, refill
        self._index = {name: j for j, name in enumerate(names)}
        self._rng = np.random.default_rng(seed)
        # schedule: slot `_pos` of epoch `epoch` (1-based, as Algorithm 1)
        self.epoch, self._pos, self.slot = 1, 0, 0
        # statistics: per request [3, M] = (tokens, seconds, observations) on each drafter,
        # per drafter the same over all requests (deviation 10: goodput = tokens / seconds)
        self._stats: dict[Hashable, np.ndarray] = {}
        self._drafter_stats = np.zeros((3, len(names)))
        # finished requests per drafter: how many were served on it, their best mean goodput
        self._served = np.zeros(len(names), dtype=int)
        self._best_request = np.zeros(len(names))
        self._retired: set[str] | None = None  # retired() until the next observe / release
        self._tokens: Counter = Counter()            # accepted tokens per request (context size)
        self._context: dict[Hashable, int] = {}      # context sizes the caller gave
        self._seconds, self._observations = 0.0, 0
        # placement
        self._home: dict[Hashable, Placement] = {}   # where each request's drafter KV lives
        self._plan_key: PlanKey | None = None
        self._plan: dict[Hashable, Placement | None] = {}
        self._draws_key: PlanKey | None = None       # random draws made in advance (fast switch)
        self._draws: dict[Hashable, Placement] = {}
        self._active: list[Hashable] = []            # ids of the last assign
        self._idle: Callable[[Hashable, str], bool] | None = None  # of the last assign
        self.switches, self.switch_seconds = 0, 0.0
        self._provisional: set[Hashable] = set()  # matched on a prior only (deviation 5)

    # ---------------------------------------------------------------------------------------
    # schedule
    @property
    def stage(self) -> str:
        """The current slot's stage: "explore" or "exploit"."""
        return "explore" if self._pos < self.alpha else "exploit"

    @property
    def slot_in_epoch(self) -> int:
        """0 .. alpha - 1 explore, alpha .. alpha + 2^epoch - 1 exploit."""
        return self._pos

    @property
    def capacity(self) -> int:
        """Requests all drafters serve at once."""
        return sum(d.replicas * d.capacity for d in self.drafters)

    def _key(self) -> PlanKey:
        return (self.epoch, self._pos // self.beta) if self._pos < self.alpha \
            else (self.epoch, "exploit")

    def _next_key(self) -> PlanKey:
        """The plan after the current one: next chunk, exploitation, next epoch's first chunk."""
        if self._pos >= self.alpha:
            return (self.epoch + 1, 0)
        chunk = self._pos // self.beta + 1
        return (self.epoch, chunk) if chunk * self.beta < self.alpha else (self.epoch, "exploit")

    def next_slot(self) -> None:
        """End the current slot (Algorithm 1: epoch k = alpha + 2^k slots)."""
        for rid in self._provisional:
            self._plan.pop(rid, None)
        self._provisional = set()
        self.slot += 1
        self._pos += 1
        if self._pos >= self.alpha + 2 ** self.epoch:
            self.epoch, self._pos = self.epoch + 1, 0

    # ---------------------------------------------------------------------------------------
    # decisions
    def assign(self, request_ids: Iterable[Hashable],
               context_tokens: Mapping[Hashable, int] | None = None,
               idle: Callable[[Hashable, str], bool] | None = None
               ) -> dict[Hashable, Placement | None]:
        """Placement of each request for the current slot (None: no drafter free, see 6.).

        Within a chunk / an exploitation stage a request keeps its placement; calling twice in
        a slot returns the same. `context_tokens` (prompt + generated) sizes the switching cost;
        without it the accepted tokens observed so far are used. `idle(request, drafter)`: the
        request would decode plainly on that drafter; exploration does not draw it (see 8.)."""
        ids = list(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request ids")
        self._idle = idle
        if context_tokens:
            self._context.update(context_tokens)
        key = self._key()
        if key != self._plan_key:
            self._plan_key, self._plan = key, {}
        # deviation 5: requests already placed in this plan keep it; new / unplaced ones fill in
        # (a request dropped from this chunk stays dropped without refill, as Algorithm 2)
        dropped_stay = key[1] != "exploit" and not self.refill
        plan = {rid: self._plan[rid] for rid in ids
                if rid in self._plan and (self._plan[rid] is not None or dropped_stay)}
        todo = [rid for rid in ids if rid not in plan]
        if todo:
            load = Counter(plan.values())
            if key[1] == "exploit":
                matched = self._match(todo, load, self._horizon_slots())
                plan.update(matched)
                # deviation 5: placed on a prior only -> matched again next slot
                self._provisional |= {rid for rid, p in matched.items() if p is not None
                                      and self._count(rid, p.drafter) == 0}
            else:
                draws = {}
                if self._draws_key == key:  # drawn in advance by likely_destination
                    draws, self._draws_key, self._draws = self._draws, None, {}
                plan.update(self._explore(todo, load, draws))
        self._plan, self._active = plan, ids
        for rid in ids:
            self._move(rid, plan[rid])
        return {rid: plan[rid] for rid in ids}

    def _move(self, rid: Hashable, to: Placement | None) -> None:
        """Count z_i(t): a switch when the request drafts elsewhere than its KV lives."""
        if to is None:  # no drafter this slot: its KV stays where it was
            return
        home = self._home.get(rid)
        if home is not None and home != to:
            self.switches += 1
            self.switch_seconds += self._switch_cost(rid, self._index[to.drafter])
        self._home[rid] = to

    def _explore(self, todo: list[Hashable], load: Counter,
                 draws: Mapping[Hashable, Placement]) -> dict[Hashable, Placement | None]:
        """Algorithm 2 lines 3-11 for one chunk: uniform draws; over capacity, a random B_j
        stay (requests placed in random order) and the others are dropped. (The pseudocode
        draws before its chunk loop; the text and Fig. 8 draw anew for every chunk, as here.)"""
        order = [todo[i] for i in self._rng.permutation(len(todo))]
        out: dict[Hashable, Placement | None] = {}
        dropped = []
        for rid in order:
            live = self._not_idle(rid, self.drafters)
            want = draws.get(rid)
            if want is None or want.drafter not in {d.name for d in live}:  # or idle since
                want = self._draw(rid, live[self._rng.integers(len(live))])
            out[rid] = self._fit(want, load)
            if out[rid] is None:
                dropped.append(rid)
        for rid in dropped:
            # deviation 2: a dropped request takes a random drafter that still has room
            room = self._not_idle(rid, [
                d for d in self.drafters
                if any(load[Placement(d.name, r)] < d.capacity for r in range(d.replicas))])
            if self.refill and room:
                d = room[self._rng.integers(len(room))]
                out[rid] = self._fit(self._draw(rid, d), load)
        return out

    def _draw(self, rid: Hashable, d: DrafterSpec | None = None) -> Placement:
        """A uniform random drafter (or `d`), among those the request is not idle on if there
        are any (deviation 8); its instance: the request's own if it is already on that
        drafter, else a uniform random one."""
        if d is None:
            live = self._not_idle(rid, self.drafters)
            d = live[self._rng.integers(len(live))]
        home = self._home.get(rid)
        if home is not None and home.drafter == d.name:
            return home
        return Placement(d.name, int(self._rng.integers(d.replicas)))

    def _not_idle(self, rid: Hashable, drafters: list[DrafterSpec] | tuple[DrafterSpec, ...]
                  ) -> list[DrafterSpec]:
        """The drafters worth drawing for the request: neither retired (deviation 9) nor ones
        it would decode plainly on (8); if none is left, those not retired; then all."""
        retired = self.retired()
        fresh = [d for d in drafters if d.name not in retired] or list(drafters)
        if self._idle is None:
            return fresh
        live = [d for d in fresh if not self._idle(rid, d.name)]
        return live or fresh

    def retired(self) -> set[str]:
        """Drafters exploration leaves out (deviation 9): served on at least `retire_after`
        requests, none of which got from it the pooled mean goodput of the best drafter.
        Computed once per change of the statistics (exploration asks for every request)."""
        if self._retired is None:
            self._retired = self._find_retired()
        return self._retired

    def _find_retired(self) -> set[str]:
        if not self.retire_after or not (self._drafter_stats[2] > 0).any():
            return set()
        best = _rates(self._drafter_stats, -np.inf).max()
        served, best_request = self._served, self._best_request
        for stats in self._stats.values():  # live requests count with their goodputs so far
            served, best_request = _with_request(served, best_request, stats)
        return {d.name for j, d in enumerate(self.drafters)
                if served[j] >= self.retire_after and best_request[j] < best}

    def _fit(self, want: Placement, load: Counter) -> Placement | None:
        """`want` if its instance has room, else the least loaded instance of the same drafter
        with room, else None. Counts the placement in `load`."""
        d = self.drafters[self._index[want.drafter]]
        if load[want] >= d.capacity:
            free = [r for r in range(d.replicas) if load[Placement(d.name, r)] < d.capacity]
            if not free:
                return None
            want = Placement(d.name, min(free, key=lambda r: load[Placement(d.name, r)]))
        load[want] += 1
        return want

    def _match(self, todo: list[Hashable], load: Counter,
               horizon_slots: int) -> dict[Hashable, Placement | None]:
        """Problem (10) by Kuhn-Munkres: one column per free batch slot of each instance."""
        cols = [Placement(d.name, r) for d in self.drafters for r in range(d.replicas)
                for _ in range(d.capacity - load[Placement(d.name, r)])]
        out: dict[Hashable, Placement | None] = dict.fromkeys(todo)
        if not cols or not todo:
            return out
        col_j = np.array([self._index[p.drafter] for p in cols])         # [C]
        g = self._goodput(todo)                                           # [N, M]
        horizon = horizon_slots * self._slot_seconds()
        cost = np.array([[self._switch_cost(rid, j) for j in range(len(self.drafters))]
                         for rid in todo])                                # [N, M]
        # deviation 3: a switch yields g for the stage's H seconds minus lambda * c of prefill
        keep = np.clip(1.0 - self.switch_weight * cost / horizon, 0.0, 1.0)
        weight = (g * keep)[:, col_j]                                     # [N, C]
        for i, rid in enumerate(todo):
            home = self._home.get(rid)
            if home is None:  # first placement: it prefills wherever it goes
                weight[i] = g[i, col_j]
                continue
            stay = [c for c, p in enumerate(cols) if p == home]
            weight[i, stay] = g[i, self._index[home.drafter]] + _STAY_BONUS
        rows, picked = linear_sum_assignment(weight, maximize=True)
        for i, c in zip(rows, picked):
            out[todo[i]] = cols[c]
        return out

    def _horizon_slots(self) -> int:
        """Slots left in the current exploitation stage, this one included."""
        return self.alpha + 2 ** self.epoch - self._pos

    def _slot_seconds(self) -> float:
        if self.slot_s is not None:
            return self.slot_s
        return self._seconds / self._observations if self._observations else 1.0

    def _switch_cost(self, rid: Hashable, j: int) -> float:
        """c_ij: seconds to prefill request `rid`'s context on drafter j."""
        d = self.drafters[j]
        tokens = self._context.get(rid, self._tokens[rid])
        return d.switch_cost_s + d.switch_cost_per_token_s * tokens

    # ---------------------------------------------------------------------------------------
    # fast switching (section IV-C)
    def likely_destinations(self) -> dict[Hashable, Placement | None]:
        """Where each request of the last `assign` drafts at the next change of plan."""
        return self._likely(list(self._active))

    def likely_destination(self, request_id: Hashable) -> Placement | None:
        """Where `request_id` drafts at the next change of plan: prefill it there in advance
        (if that is not where it is now). Exact unless requests, capacity or (in exploitation)
        the estimates change meanwhile."""
        ids = list(self._active)
        if request_id not in ids:
            ids.append(request_id)
        return self._likely(ids)[request_id]

    def _likely(self, ids: list[Hashable]) -> dict[Hashable, Placement | None]:
        key = self._next_key()
        if key[1] == "exploit":
            # deviation 7: the matching itself, not argmax_j g~[i, j]
            return self._match(ids, Counter(), 2 ** key[0])
        # exploration: draw the next chunk now and keep the draws for it (Algorithm 2 line 4)
        if self._draws_key != key:
            self._draws_key, self._draws = key, {}
        for rid in ids:
            if rid not in self._draws:
                self._draws[rid] = self._draw(rid)
        return {rid: self._draws[rid] for rid in ids}

    # ---------------------------------------------------------------------------------------
    # feedback
    def observe(self, request_id: Hashable, drafter: str, accepted_tokens: float,
                seconds: float) -> None:
        """One slot's feedback: request i emitted `accepted_tokens` in `seconds` on drafter j
        (r_ij = their ratio; estimates are ratios of sums, deviation 10)."""
        if drafter not in self._index:
            raise ValueError(f"unknown drafter {drafter!r}; known: {list(self._index)}")
        if not accepted_tokens >= 0 or not math.isfinite(accepted_tokens):
            raise ValueError(f"accepted_tokens must be a finite number >= 0, got {accepted_tokens}")
        if not seconds > 0 or not math.isfinite(seconds):
            raise ValueError(f"seconds must be finite and > 0, got {seconds}")
        j = self._index[drafter]
        # deviation 4: every observation counts, not only the exploration stage's
        stats = self._stats.setdefault(request_id, np.zeros((3, len(self.drafters))))
        stats[:, j] += (accepted_tokens, seconds, 1)
        self._drafter_stats[:, j] += (accepted_tokens, seconds, 1)
        self._retired = None
        self._tokens[request_id] += accepted_tokens
        self._seconds += seconds
        self._observations += 1

    def _count(self, rid: Hashable, drafter: str) -> int:
        """Observations of request `rid` on `drafter`."""
        stats = self._stats.get(rid)
        return 0 if stats is None else int(stats[2, self._index[drafter]])

    def _goodput(self, ids: list[Hashable]) -> np.ndarray:
        """g~ [N, M]: each pair's tokens / seconds, with the drafter's overall goodput counted
        as `prior_weight` mean-length slots of it (deviation 4); that goodput where a pair is
        unobserved."""
        prior = _rates(self._drafter_stats)                                      # [M]
        g = np.tile(prior, (len(ids), 1))
        pseudo = self.prior_weight * self._slot_seconds()  # seconds the prior counts as
        for i, rid in enumerate(ids):
            if rid in self._stats:
                tokens, seconds, n = self._stats[rid]
                g[i] = np.where(n > 0, (tokens + pseudo * prior)
                                / np.maximum(seconds + pseudo, 1e-12), prior)
        return g

    def estimates(self) -> dict[Hashable, dict[str, Estimate]]:
        """g~ and observation counts of every request seen, per drafter."""
        ids = list(self._stats)
        g = self._goodput(ids)
        return {rid: {d.name: Estimate(float(g[i, j]), int(self._stats[rid][2, j]))
                      for j, d in enumerate(self.drafters)} for i, rid in enumerate(ids)}

    def release(self, request_id: Hashable) -> None:
        """Forget a finished request (its drafter-level contribution stays)."""
        stats = self._stats.get(request_id)
        if stats is not None:
            self._served, self._best_request = _with_request(self._served, self._best_request,
                                                             stats)
            self._retired = None
        for table in (self._stats, self._context, self._home, self._plan, self._draws):
            table.pop(request_id, None)
        self._provisional.discard(request_id)
        self._tokens.pop(request_id, None)
        self._active = [rid for rid in self._active if rid != request_id]
