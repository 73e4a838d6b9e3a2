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

alone (one request in flight), and with others in flight

    budget = argmax_n (E_others + E_request(n)) / (V(R_others + 1 + n) + D_others + D_arm(n))

the rate of the whole batch: V(rows) = the verifier's pass time over its rows (reported with
every result, regressed router-wide over passes that only decoded), D_arm(n) = the drafters'
time for an n-node budget on this arm (reported by the drafter and the datastore), and
R_others, D_others, E_others = rows (nodes + one root each), drafting time and expected tokens
of the other requests' current plans (`BatchShare`). A request's tree then pays for the time
it adds to every request's step, not only to its own: regressing the wall time of a request's
step on its own tree size, as alone, made "off" never look cheaper with 8 in flight
(docs/decisions/adaptive-tree-size.md). The wall time also mixes in waits for other requests'
work; V and D are measured where the work is done. D_others is a sum: drafters on the
verifier's cores (the embedded mesh) or one drafter process draft the trees one after another
(a fleet of drafters in parallel makes this conservative). Deviation: ProPD chooses one size
for the batch when the batch size changes; here each request chooses, knowing the others' plans.

Deviations from ProPD, each for a reason:
- T is the router's wall time of a step (drafting + pool + verification + result), not the
  verifier's forward time alone: ProPD's drafts are Medusa heads, nearly free; ours are draft
  models and a lookup service, whose cost the choice must see. With n = 0 nothing is drafted,
  so T(0) is exactly the cost of plain decoding through the verifier.
- T(n) and V(rows) are `StepTimeModel.curve`: a size's own EMA where it was measured
  recently, the recency-weighted line only for the sizes not run lately. Costs that grow in
  steps (FBGEMM's fp16 GEMM takes rows in blocks of 6 on AVX2) are misread by a line on both
  sides of each step.
- The choice is recomputed every step, not only when batch size or context length change:
  the profile is per request and moves every step, and the greedy best-tree scan costs
  ~0.1 ms against steps of tens of milliseconds.
- Probing: every `probe_every` steps a request runs one step at a neighbouring size (in turn
  one node more, one less, double, half the chosen one: the adjacent sizes see a cost that
  grows in steps, double and half the slope). Without it the fitted line would keep the slope
  of whatever two sizes were measured first (two points fit exactly, whatever their weights),
  and an "off" request would never learn that its text became predictable again (no tree
  verified, no acceptance observed). An off request probes 4x less often and with a 2-node
  tree (a probe costs what a tree costs over a plain step), and at once when it starts off on
  the arm's prior alone; if its first two tokens are accepted the choice turns speculation
  back on, after which the deeper levels learn again. An off request skips
  its probe when even a tree whose every node were accepted would not beat plain decoding at
  the current costs: a probe can only teach acceptance, and on a model arm it also costs a
  drafter prefill (costs measured: docs/decisions/adaptive-tree-size.md).
- Bootstrap: until a bucket has two measured sizes, the default size and then size 0 are run.
  With others in flight, until V and D are measured one request of the arm at a time drafts
  the default size and the others decode plainly (eight requests each bootstrapping a model
  arm cost eight drafter prefills). D starts as the drafter's own measurement where it
  reported one (`draft_prior`: one forward per tree level, timed when the model was loaded),
  so a model arm whose drafting cannot pay in the current batch is never bootstrapped.

This is the "adaptive" strategy (`sizing.AdaptiveSize`). `speculation.tree_size` picks the
strategy of every arm once (`sizing.py`): "fixed" drafts the configured tree every step;
"length" swaps ProPD's choice for Minions' adaptive speculation length (`length.py`, section
3.3): one selector per arm watches step time / emitted tokens and moves the budget s up or down
by the slope of that ratio; every request of the arm drafts s nodes. Whatever the strategy,
the costs, the prior and each request's profile learn from every step (`RequestSizing.observe`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.sizing import make_strategy
from specmesh_services.router.steps import (BatchShare, PassTimes, StepChoice, VerifyStep,
                                            bucket_of)
from specmesh_services.router.tree_size import (AcceptanceProfile, LinearCost, StepTimeModel,
                                                TreeSizeConfig)
from specmesh.v1 import common_pb2


class TreeSizing:
    """Router-wide part of one arm: its size strategy, step-time models per concurrency bucket,
    the arm's drafting time, the prior profile; and the verifier's pass time (`verify_times`,
    over rows), which the router shares between its arms."""

    def __init__(self, max_nodes: int, max_depth: int, probe_every: int = 16,
                 config: TreeSizeConfig | None = None, mode: str = "adaptive",
                 verify_times: PassTimes | None = None,
                 draft_prior: Callable[[int], float] | None = None,
                 self_sized: bool = False) -> None:
        """`mode`: the strategy, "fixed" (the whole tree every step), "adaptive" (ProPD) or
        "length" (Minions). `verify_times`: None = no batched choice (every concurrency uses
        the step-time model of its bucket). `draft_prior`: the arm's drafting seconds as a
        function of the budget until they have been timed (the drafters' own measurement): a
        batch need not bootstrap an arm whose drafting it can already tell does not pay.
        `self_sized`: the arm's tree is one draft model's chain under a confidence stop."""
        if max_nodes < 0 or max_depth < 0:
            raise ValueError("need max_nodes >= 0 and max_depth >= 0")
        self.strategy = make_strategy(mode, max_nodes, probe_every, self_sized)
        self.max_nodes = max_nodes
        base = config or TreeSizeConfig()
        self.config = TreeSizeConfig(
            max_size=max_nodes, max_depth=max(max_depth, 1), max_rank=base.max_rank,
            time_alpha=base.time_alpha, age_decay=base.age_decay, prob_alpha=base.prob_alpha,
            prior_top1=base.prior_top1, default_size=min(base.default_size, max_nodes),
            context_tolerance=base.context_tolerance, prior_weight=base.prior_weight)
        # the arm's prior counts as `prior_weight` observations, like a request's start: its
        # initial P (prior_top1) is a guess, not 1 / alpha = 20 observations (a layer-truncated
        # draft that the target never followed still promised 1.5-2 tokens per step after
        # 10 of its trees had all failed, and every new request tried it again)
        self.prior = AcceptanceProfile(self.config.max_depth, self.config.max_rank,
                                       self.config.prob_alpha, self.config.prior_top1
                                       ).fresh(self.config.prior_weight)
        self.times: dict[int, StepTimeModel] = {}
        self.verify_times = verify_times
        # drafter seconds of one request's tree as a function of its budget (0 for budget 0)
        self.draft_times = StepTimeModel(self.config.time_alpha, self.config.age_decay)
        self.draft_prior = draft_prior

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
        """Seconds of a step shared with `others` as a function of this request's tree size n:
        the verifier's pass over everyone's rows plus everyone's drafting,
        V(others' rows + 1 + n) + others' drafting + D(n), and for a tree the request's
        drafter prefill still pending (`BatchShare.switch_seconds`). None until V and D are
        measured."""
        verify = self.verify_times.curve() if self.verify_times is not None else None
        draft = self.draft_times.estimate() or self.draft_prior
        if verify is None or draft is None:
            return None
        rows = others.nodes + others.requests + 1
        return lambda n: (verify(rows + n) + others.draft_seconds
                          + (draft(n) + others.switch_seconds if n else 0.0))

    def draft_seconds(self, n: int) -> float:
        """The expected drafting seconds of an n-node tree (D(n), measured or the drafter's
        prior; 0 for no tree or before either exists)."""
        draft = self.draft_times.estimate() or self.draft_prior
        return draft(n) if n and draft is not None else 0.0

    def for_request(self) -> "RequestSizing":
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

    def choose(self, in_flight: int, others: BatchShare = BatchShare()) -> StepChoice:
        self.choices += 1
        return self.shared.strategy.choose(self, in_flight, others)

    def would_speculate(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether a step now would draft (`SizeStrategy.would_speculate`)."""
        return self.shared.strategy.would_speculate(self, in_flight, others)

    def runs_plain(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether no tree of this arm pays now (`SizeStrategy.runs_plain`); counts as no
        step."""
        return self.shared.strategy.runs_plain(self, in_flight, others)

    def ahead_budget(self, budget: int, in_flight: int, others: BatchShare = BatchShare()
                     ) -> int:
        """The node limit of the next step's tree drafted ahead (`SizeStrategy.ahead_budget`)."""
        return self.shared.strategy.ahead_budget(self, budget, in_flight, others)

    def observe(self, step: int, choice: StepChoice, tree: TokenTree, emitted: list[int],
                seconds: float, in_flight: int, drafters: list[str], arm: str = "",
                verify: VerifyStep | None = None, draft_seconds: float = 0.0,
                switch_seconds: float = 0.0) -> common_pb2.StepDecision:
        """One finished step: updates the models and records the decision. `verify`: the
        verifier's pass the tree was in; `draft_seconds`: the drafters' time for this tree;
        `switch_seconds`: of `seconds`, the wait for a drafter's prefill of this request (its
        first step on that drafter): the step-time model learns the step without it, or the
        one step that paid for a switch would price the arm's trees at a prefill and keep the
        router off the arm (docs/decisions/adaptive-tree-size.md).

        The models skip the request's prefill step and passes that also prefilled another
        request: their time is a prefill's, whatever the trees' sizes."""
        shared = self.shared
        step_seconds = max(seconds - switch_seconds, 0.0)
        if step > 0:
            if verify is None or not verify.prefilled:
                shared.time_model(bucket_of(in_flight)).observe(len(tree), step_seconds)
                if verify is not None and shared.verify_times is not None:
                    shared.verify_times.observe_pass(verify)
            timed = choice.budget > 0 and draft_seconds > 0
            if timed:
                # at the size drafted: a confidence-stopped chain runs one forward per node it
                # returns, whatever its budget (a chain asked for 8 that stopped at 3 cost 3
                # levels); timed at the budget, every size looked like the full chain's cost
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
