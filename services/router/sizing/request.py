"""The tree sizing's state: router-wide per arm (`TreeSizing`: its strategy, step-time models
per concurrency bucket, drafting times, the prior acceptance profile) and per request and arm
(`RequestSizing`: its own profile, started as a copy of the prior, its choices and records).

Each step the request hands the arm's strategy what it chooses from (`ChoiceInputs`, with the
costs priced here: the bucket's step time alone, the batch's with others in flight, `BatchShare`
being the others' plans); `observe` then teaches the costs, the prior and the request's profile
what came of the step, whatever the strategy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.sizing.acceptance import AcceptanceProfile
from specmesh_services.router.sizing.choice import ChoiceInputs, StepChoice, StepCosts
from specmesh_services.router.sizing.cost import (LinearCost, PassTimes, StepTimeModel,
                                                  VerifyStep, bucket_of)
from specmesh_services.router.sizing.strategies import make_strategy
from specmesh.v1 import common_pb2


@dataclass(frozen=True)
class SizingConfig:
    """The models' parameters; ProPD names alpha and lambda but gives no values: ours."""

    max_depth: int = 8  # depths with tracked probabilities (ProPD: number of heads)
    max_rank: int = 4  # ranks tracked per depth (ProPD: top-K)
    time_alpha: float = 0.3  # alpha of the T_perf EMA
    age_decay: float = 0.02  # lambda of W_i = exp(-lambda o_i), o_i counted in observed steps
    prob_alpha: float = 0.05  # alpha of the P EMA
    prior_weight: float = 4.0  # observations the prior counts as in a request's profile
    # initial P_d^k = 1 - (1 - prior_top1)^k (ProPD does not say how P starts; from 0 every
    # tree would be worth nothing and the first choice would switch speculation off for good)
    prior_top1: float = 0.5
    default_size: int = 8  # the bootstrap's size, until the time model has two sizes

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_rank < 1:
            raise ValueError("need max_depth >= 1, max_rank >= 1")
        for name in ("time_alpha", "prob_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if not 0 <= self.prior_top1 <= 1 or self.age_decay < 0 or self.prior_weight < 1:
            raise ValueError("need 0 <= prior_top1 <= 1, age_decay >= 0, prior_weight >= 1")


@dataclass(frozen=True)
class BatchShare:
    """What a request's step shares its time with: the other requests' plans for their current
    step, and its own drafter prefill still to pay."""

    nodes: int = 0  # draft nodes of their trees
    tokens: float = 0.0  # tokens their steps are expected to emit, bonus included
    requests: int = 0  # how many they are (one root row each in the verify pass)
    draft_seconds: float = 0.0  # drafter time their trees take
    # the request's own prefill on the arm's drafters, not yet done: a tree now waits for it
    # (SPIN's switching cost, eq. 6, charged to the step that pays it)
    switch_seconds: float = 0.0


class TreeSizing:
    """Router-wide part of one arm: its size strategy, step-time models per concurrency bucket,
    the arm's drafting time, the prior profile; and the verifier's pass time (`verify_times`,
    over rows), which the router shares between its arms."""

    def __init__(self, max_nodes: int, max_depth: int, probe_every: int = 16,
                 config: SizingConfig | None = None, mode: str = "adaptive",
                 verify_times: PassTimes | None = None,
                 draft_prior: Callable[[int], float] | None = None,
                 self_sized: bool = False, plain_tokens: int = 1) -> None:
        """`mode`: the strategy, "fixed" (the whole tree every step), "adaptive" (ProPD) or
        "length" (Minions). `verify_times`: None = no batched choice (every concurrency uses
        the step-time model of its bucket). `draft_prior`: the arm's drafting seconds as a
        function of the budget until they have been timed (the drafters' own measurement): a
        batch need not bootstrap an arm whose drafting it can already tell does not pay.
        `self_sized`: the arm's tree is one draft model's chain under a confidence stop.
        `plain_tokens`: the tokens a step without trees decodes a round trip (plain runs)."""
        if max_nodes < 0 or max_depth < 0:
            raise ValueError("need max_nodes >= 0 and max_depth >= 0")
        base = config or SizingConfig()
        self.config = replace(base, max_depth=max(max_depth, 1),
                              default_size=min(base.default_size, max_nodes))
        self.max_nodes = max_nodes
        self.strategy = make_strategy(mode, max_nodes, self.config.default_size,
                                      self.config.max_depth, probe_every, self_sized)
        # the arm's prior counts as `prior_weight` observations, like a request's start: its
        # initial P (prior_top1) is a guess (docs/decisions/adaptive-tree-size.md)
        self.prior = AcceptanceProfile(self.config.max_depth, self.config.max_rank,
                                       self.config.prob_alpha, self.config.prior_top1
                                       ).fresh(self.config.prior_weight)
        self.times: dict[int, StepTimeModel] = {}
        self.verify_times = verify_times
        # drafter seconds of one request's tree as a function of its budget (0 for budget 0)
        self.draft_times = StepTimeModel(self.config.time_alpha, self.config.age_decay)
        self.draft_prior = draft_prior
        self.plain_tokens = max(plain_tokens, 1)

    @property
    def adaptive(self) -> bool:
        """Whether the budget shapes the draft (its depth, the lookup's nodes, pruning to the
        budget): every strategy but the fixed tree."""
        return self.strategy.sizes_draft

    def time_model(self, bucket: int) -> StepTimeModel:
        model = self.times.get(bucket)
        if model is None:
            model = self.times[bucket] = StepTimeModel(self.config.time_alpha,
                                                       self.config.age_decay)
        return model

    def cost(self, bucket: int) -> LinearCost | None:
        return self.time_model(bucket).fit()

    def batch_cost(self, others: BatchShare) -> Callable[[int], float] | None:
        """Seconds of a round of a step shared with `others` as a function of this request's
        tree size n: the verifier's pass over everyone's rows, V(R) with R = others' rows + 1,
        plus what n nodes add to it, plus everyone's drafting (D(n) and, for a tree, the
        request's drafter prefill still pending: `BatchShare.switch_seconds`), plus the round
        trip through router and pool. A step without trees decodes `plain_tokens` rounds a
        trip (plain runs): one tree makes it one round for the whole batch. What n nodes add
        is the dearer of the verifier's per-row fit (context and requests held fixed) and the
        measured V(R + n) - V(R). None until V (or one size of it and the per-row fit) and D
        are measured."""
        times = self.verify_times
        verify = times.curve() if times is not None else None
        if verify is None and times is not None and times.row_seconds > 0:
            verify = times.estimate()
        draft = self.draft_times.estimate() or self.draft_prior
        if verify is None or draft is None:
            return None
        rows = others.nodes + others.requests + 1
        base, row, trip = verify(rows), times.row_seconds, times.turnaround_seconds
        runs = self.plain_tokens if not others.nodes else 1
        shared = base + others.draft_seconds

        def seconds(n: int) -> float:
            if not n:
                return shared + trip / runs
            added = max(row * n, verify(rows + n) - base)
            return shared + added + draft(n) + others.switch_seconds + trip
        return seconds

    def step_costs(self, in_flight: int, others: BatchShare) -> StepCosts:
        """What a step now costs: with others in flight (and the verifier's pass time shared),
        the batch's (`batch_cost`); else the step time of the concurrency's bucket."""
        if in_flight > 1 and self.verify_times is not None:
            return StepCosts(self.batch_cost(others), batched=True, other_tokens=others.tokens)
        model = self.time_model(bucket_of(in_flight))
        return StepCosts(model.curve(), measured_sizes=model.sizes())

    def draft_seconds(self, n: int) -> float:
        """The expected drafting seconds of an n-node tree (D(n), measured or the drafter's
        prior; 0 for no tree or before either exists)."""
        draft = self.draft_times.estimate() or self.draft_prior
        return draft(n) if n and draft is not None else 0.0

    def for_request(self) -> RequestSizing:
        return RequestSizing(self, self.prior.fresh(self.config.prior_weight))


@dataclass
class RequestSizing:
    """Per-request part: its acceptance profile, its choices and their outcomes. What a choice
    is, is the arm's strategy's (`shared.strategy`)."""

    shared: TreeSizing
    profile: AcceptanceProfile
    decisions: list[common_pb2.StepDecision] = field(default_factory=list)
    choices: int = 0  # steps it chose a size for on this arm
    trees: int = 0  # its own trees verified

    def _inputs(self, in_flight: int, others: BatchShare) -> ChoiceInputs:
        shared = self.shared
        costs = shared.step_costs(in_flight, others) if shared.strategy.prices else None
        return ChoiceInputs(self.profile, self.choices, self.trees, costs, max(1, in_flight))

    def choose(self, in_flight: int, others: BatchShare = BatchShare()) -> StepChoice:
        self.choices += 1
        return self.shared.strategy.choose(self._inputs(in_flight, others))

    def would_speculate(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether a step now would draft (`SizeStrategy.would_speculate`)."""
        return self.shared.strategy.would_speculate(self._inputs(in_flight, others))

    def runs_plain(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether no tree of this arm pays now (`SizeStrategy.runs_plain`); counts as no
        step."""
        return self.shared.strategy.runs_plain(self._inputs(in_flight, others))

    def ahead_budget(self, budget: int, in_flight: int, others: BatchShare = BatchShare()
                     ) -> int:
        """The node limit of the next step's tree drafted ahead (`SizeStrategy.ahead_budget`)."""
        return self.shared.strategy.ahead_budget(self._inputs(in_flight, others), budget)

    def observe(self, step: int, choice: StepChoice, tree: TokenTree, emitted: list[int],
                seconds: float, in_flight: int, drafters: list[str], arm: str = "",
                verify: VerifyStep | None = None, draft_seconds: float = 0.0,
                switch_seconds: float = 0.0) -> common_pb2.StepDecision:
        """One finished step: updates the models and records the decision. `verify`: the
        verifier's pass the tree was in; `draft_seconds`: the drafters' time for this tree;
        `switch_seconds`: of `seconds`, the wait for a drafter's prefill of this request (its
        first step on that drafter), which the step-time model does not learn (one step that
        paid for a switch would keep the router off the arm). Nor does it learn the request's
        prefill step or passes that also prefilled another request: their time is a prefill's
        (docs/decisions/adaptive-tree-size.md)."""
        shared = self.shared
        step_seconds = max(seconds - switch_seconds, 0.0)
        if step > 0:
            if verify is None or not verify.prefilled:
                # a plain run decodes its tokens one forward each: its steps are those
                plain = step_seconds / len(emitted) if not len(tree) and emitted else step_seconds
                shared.time_model(bucket_of(in_flight)).observe(len(tree), plain)
                if verify is not None and shared.verify_times is not None:
                    shared.verify_times.observe_pass(verify)
            timed = choice.budget > 0 and draft_seconds > 0
            if timed:
                # at the size drafted: a confidence-stopped chain runs one forward per node it
                # returns, whatever its budget
                shared.draft_times.observe(len(tree) or choice.budget, draft_seconds)
            shared.strategy.observe(choice, len(emitted), step_seconds, timed)
            if len(tree):
                self.trees += 1
                self.profile.observe_tree(tree, emitted)
                shared.prior.observe_tree(tree, emitted)
        record = common_pb2.StepDecision(
            step=step, budget=choice.budget, tree_size=len(tree),
            expected_length=choice.expected_length, emitted=len(emitted), seconds=seconds,
            drafters=drafters, probe=choice.probe, arm=arm, switch_seconds=switch_seconds)
        self.decisions.append(record)
        return record
