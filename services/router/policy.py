"""Speculation policy: how many draft nodes each step of each request asks for, and the record
of what came of it. Composes ProPD's dynamic tree size (`tree_size.py`, section 4.2) into the
router.

Router-wide (`TreeSizing`): one `StepTimeModel` per concurrency bucket (requests in flight at
the router, rounded up to a power of two: a step's time depends on how many trees share the
verifier's forward pass; ProPD recomputes "when the batch size changes"), and a prior
`AcceptanceProfile` learnt from every request. Per request (`RequestSizing`): its own profile,
started as a copy of the prior and updated by its own walks (a code request and a chat request
accept very differently), and the choice each step:

    budget = argmax_n E_request(n) / T_bucket(n),   n = 0 .. max_nodes, 0 = speculation off

Deviations from ProPD, each for a reason:
- T is the router's wall time of a step (drafting + pool + verification + result), not the
  verifier's forward time alone: ProPD's drafts are Medusa heads, nearly free; ours are draft
  models and a lookup service, whose cost the choice must see. With n = 0 nothing is drafted,
  so T(0) is exactly the cost of plain decoding through the verifier.
- The choice is recomputed every step, not only when batch size or context length change:
  the profile is per request and moves every step, and the greedy best-tree scan costs
  ~0.1 ms against steps of tens of milliseconds.
- Probing: every `probe_every` steps a request runs one step at a neighbouring size (half or
  double the chosen one). Without it the fitted line would keep the slope of whatever two
  sizes were measured first (two points fit exactly, whatever their weights), and an "off"
  request would never learn that its text became predictable again (no tree verified, no
  acceptance observed). An off request probes 4x less often and with a 2-node tree: a probe
  costs what a tree costs over a plain step (on a CPU verifying rows at ~40% of a plain step
  each, an 8-node probe every 16 steps alone would cost ~6% of plain speed), and if its
  first two tokens are accepted the choice turns speculation back on, after which the
  deeper levels learn again.
- Bootstrap: until a bucket has two measured sizes, the default size and then size 0 are run.

`mode="length"` swaps ProPD's choice for Minions' adaptive speculation length (`length.py`,
section 3.3): one selector per arm watches step time / emitted tokens and moves the budget s
up or down by the slope of that ratio; every request of the arm drafts s nodes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from services.common.tree import TokenTree
from services.router.length import LengthConfig, SpeculationLengthSelector
from services.router.tree_size import (AcceptanceProfile, LinearCost, StepTimeModel,
                                       TreeSizeConfig, best_size)
from specmesh.v1 import common_pb2


OFF_PROBE_SPACING = 4  # an off request probes every 4 * probe_every steps
OFF_PROBE_SIZE = 2


@dataclass(frozen=True)
class StepChoice:
    budget: int  # node budget for the draft sources, 0 = speculation off
    expected_length: float  # E(budget), bonus included, under the request's profile
    probe: bool = False


def bucket_of(in_flight: int) -> int:
    """1, 2, 4, 8, ...: the concurrency bucket of a step-time model."""
    return 1 << max(in_flight - 1, 0).bit_length()


class TreeSizing:
    """Router-wide part: step-time models per concurrency bucket and the prior profile."""

    def __init__(self, max_nodes: int, max_depth: int, adaptive: bool = True,
                 probe_every: int = 16, config: TreeSizeConfig | None = None,
                 mode: str | None = None) -> None:
        """`mode`: "fixed" (the whole tree every step), "adaptive" (ProPD), "length" (Minions);
        default from `adaptive`."""
        if max_nodes < 0 or max_depth < 0:
            raise ValueError("need max_nodes >= 0 and max_depth >= 0")
        mode = mode or ("adaptive" if adaptive else "fixed")
        if mode not in ("fixed", "adaptive", "length"):
            raise ValueError(f"unknown tree-size mode {mode!r}")
        self.max_nodes = max_nodes
        self.mode = mode if max_nodes > 0 else "fixed"
        # the budget drives the draft (depth, lookup nodes, pruning) unless the tree is fixed
        self.adaptive = self.mode != "fixed"
        self.length = (SpeculationLengthSelector(LengthConfig(
            s_init=min(4, max_nodes), s_max=max_nodes)) if self.mode == "length" else None)
        self.probe_every = probe_every
        base = config or TreeSizeConfig()
        self.config = TreeSizeConfig(
            max_size=max_nodes, max_depth=max(max_depth, 1), max_rank=base.max_rank,
            time_alpha=base.time_alpha, age_decay=base.age_decay, prob_alpha=base.prob_alpha,
            prior_top1=base.prior_top1, default_size=min(base.default_size, max_nodes),
            context_tolerance=base.context_tolerance)
        self.prior = AcceptanceProfile(self.config.max_depth, self.config.max_rank,
                                       self.config.prob_alpha, self.config.prior_top1)
        self.times: dict[int, StepTimeModel] = {}

    def time_model(self, bucket: int) -> StepTimeModel:
        model = self.times.get(bucket)
        if model is None:
            model = self.times[bucket] = StepTimeModel(self.config.time_alpha,
                                                       self.config.age_decay)
        return model

    def cost(self, bucket: int) -> LinearCost | None:
        return self.time_model(bucket).fit()

    def for_request(self) -> "RequestSizing":
        return RequestSizing(self, copy.deepcopy(self.prior))


@dataclass
class RequestSizing:
    """Per-request part: its acceptance profile, its choices and their outcomes."""

    shared: TreeSizing
    profile: AcceptanceProfile
    decisions: list[common_pb2.StepDecision] = field(default_factory=list)
    _speculated: int = 0  # steps after the prefill step

    def choose(self, in_flight: int) -> StepChoice:
        shared = self.shared
        if shared.max_nodes == 0:
            return StepChoice(0, 1.0)
        curve = self.profile.expected_tokens(shared.max_nodes)
        top = len(curve) - 1
        if not shared.adaptive:
            return StepChoice(shared.max_nodes, curve[top])
        if shared.length is not None:
            s = min(shared.length.s, top)
            return StepChoice(s, curve[s])
        self._speculated += 1
        model = shared.time_model(bucket_of(in_flight))
        cost = model.fit()
        if cost is None:  # bootstrap: the default size, then plain, then the fit exists
            seen = set(model._perf)
            size = shared.config.default_size if not seen or 0 in seen else 0
            return StepChoice(min(size, top), curve[min(size, top)], probe=True)
        choice = best_size(curve, cost)
        size = choice.size if choice is not None else shared.config.default_size
        every = shared.probe_every * (OFF_PROBE_SPACING if size == 0 else 1)
        if every and self._speculated % every == 0:
            size, probe = self._neighbour(size, top), True
        else:
            probe = False
        return StepChoice(size, curve[size], probe)

    def _neighbour(self, size: int, top: int) -> int:
        if size == 0:
            return min(OFF_PROBE_SIZE, top)
        up, down = min(2 * size, top), size // 2
        # alternate below and above the chosen size
        return up if (self._speculated // self.shared.probe_every) % 2 and up != size else down

    def observe(self, step: int, choice: StepChoice, tree: TokenTree, emitted: list[int],
                seconds: float, in_flight: int, drafters: list[str], arm: str = ""
                ) -> common_pb2.StepDecision:
        """One finished step: updates the models (not for the prefill step, whose time is a
        prefill's) and records the decision."""
        if step > 0:
            self.shared.time_model(bucket_of(in_flight)).observe(len(tree), seconds)
            if self.shared.length is not None and choice.budget > 0:
                self.shared.length.observe(seconds, [len(emitted) - 1])
            if len(tree):
                self.profile.observe_tree(tree, emitted)
                self.shared.prior.observe_tree(tree, emitted)
        record = common_pb2.StepDecision(
            step=step, budget=choice.budget, tree_size=len(tree),
            expected_length=choice.expected_length, emitted=len(emitted), seconds=seconds,
            drafters=drafters, probe=choice.probe, arm=arm)
        self.decisions.append(record)
        return record
