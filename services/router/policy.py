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

`mode="length"` swaps ProPD's choice for Minions' adaptive speculation length (`length.py`,
section 3.3): one selector per arm watches step time / emitted tokens and moves the budget s
up or down by the slope of that ratio; every request of the arm drafts s nodes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.length import LengthConfig, SpeculationLengthSelector
from specmesh_services.router.tree_size import (AcceptanceProfile, LinearCost, StepTimeModel,
                                       TreeSizeConfig, best_size)
from specmesh.v1 import common_pb2


OFF_PROBE_SPACING = 4  # an off request probes every 4 * probe_every steps
OFF_PROBE_SIZE = 2
BOOTSTRAP_TIMEOUT = 64  # choices after which a batch bootstrap draft that never came back is retried


@dataclass(frozen=True)
class StepChoice:
    budget: int  # node budget for the draft sources, 0 = speculation off
    expected_length: float  # E(budget), bonus included, under the request's profile
    probe: bool = False


@dataclass(frozen=True)
class BatchShare:
    """What the other requests in flight plan for their current step."""

    nodes: int = 0  # draft nodes of their trees
    tokens: float = 0.0  # tokens their steps are expected to emit, bonus included
    requests: int = 0  # how many they are (one root row each in the verify pass)
    draft_seconds: float = 0.0  # drafter time their trees take


@dataclass(frozen=True)
class VerifyStep:
    """What the verifier reported of the forward pass a tree was verified in."""

    seconds: float  # the forward pass and walk
    rows: int  # rows of the pass
    trees: int  # trees verified in it
    nodes: int  # their draft nodes
    verifier: str = ""  # who ran it

    @property
    def prefilled(self) -> bool:
        """The pass also prefilled (or caught up) a request: rows beyond one per tree + nodes."""
        return self.rows > self.nodes + self.trees


@dataclass
class PassTimes(StepTimeModel):
    """The verifier's pass time over its rows (V). Every tree of a pass reports the same pass;
    it is counted once, so a pass of 8 trees neither outweighs a pass of 1 nor ages the other
    sizes 8 steps at a time."""

    _seen: deque = field(default_factory=deque, init=False, repr=False)  # the last 256 passes
    _seen_keys: set = field(default_factory=set, init=False, repr=False)  # the same, to look up

    def observe_pass(self, step: VerifyStep) -> None:
        key = (step.verifier, step.seconds, step.rows)
        if key not in self._seen_keys:
            self._seen.append(key)
            self._seen_keys.add(key)
            if len(self._seen) > 256:
                self._seen_keys.discard(self._seen.popleft())
            self.observe(step.rows, step.seconds)


def bucket_of(in_flight: int) -> int:
    """1, 2, 4, 8, ...: the concurrency bucket of a step-time model."""
    return 1 << max(in_flight - 1, 0).bit_length()


class TreeSizing:
    """Router-wide part of one arm: step-time models per concurrency bucket, the arm's drafting
    time, the prior profile; and the verifier's pass time (`verify_times`, over rows), which
    the router shares between its arms."""

    def __init__(self, max_nodes: int, max_depth: int, adaptive: bool = True,
                 probe_every: int = 16, config: TreeSizeConfig | None = None,
                 mode: str | None = None, verify_times: PassTimes | None = None,
                 draft_prior: Callable[[int], float] | None = None) -> None:
        """`mode`: "fixed" (the whole tree every step), "adaptive" (ProPD), "length" (Minions);
        default from `adaptive`. `verify_times`: None = no batched choice (every concurrency
        uses the step-time model of its bucket). `draft_prior`: the arm's drafting seconds as a
        function of the budget until they have been timed (the drafters' own measurement): a
        batch need not bootstrap an arm whose drafting it can already tell does not pay."""
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
        self.choices = 0  # choices made on this arm (its clock)
        self.bootstrap_until = 0  # a batch bootstrap draft is out until this choice

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
        V(others' rows + 1 + n) + others' drafting + D(n). None until both are measured."""
        verify = self.verify_times.curve() if self.verify_times is not None else None
        draft = self.draft_times.estimate() or self.draft_prior
        if verify is None or draft is None:
            return None
        rows = others.nodes + others.requests + 1
        return lambda n: verify(rows + n) + others.draft_seconds + (draft(n) if n else 0.0)

    def for_request(self) -> "RequestSizing":
        return RequestSizing(self, self.prior.fresh(self.config.prior_weight))


@dataclass
class RequestSizing:
    """Per-request part: its acceptance profile, its choices and their outcomes."""

    shared: TreeSizing
    profile: AcceptanceProfile
    decisions: list[common_pb2.StepDecision] = field(default_factory=list)
    _speculated: int = 0  # steps after the prefill step
    _trees: int = 0  # its own trees verified

    def choose(self, in_flight: int, others: BatchShare = BatchShare()) -> StepChoice:
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
        shared.choices += 1
        size = self._optimum(curve, in_flight, others)
        if size is None and self.batched(in_flight):
            # bootstrap of the batch costs: one request of the arm at a time drafts the default
            # size (measuring D and a second pass size for V), the others decode plainly
            if shared.choices < shared.bootstrap_until:
                return StepChoice(0, 1.0)
            shared.bootstrap_until = shared.choices + BOOTSTRAP_TIMEOUT
            size = min(shared.config.default_size, top)
            return StepChoice(size, curve[size], probe=True)
        if size is None:  # bootstrap: the default size, then plain, then the fit exists
            seen = set(shared.time_model(bucket_of(in_flight))._perf)
            size = shared.config.default_size if not seen or 0 in seen else 0
            return StepChoice(min(size, top), curve[min(size, top)], probe=True)
        every = shared.probe_every * (OFF_PROBE_SPACING if size == 0 else 1)
        probe = False
        # off from its first step on the arm's prior alone (the requests before it): it probes
        # at once, as its own text may be predictable where theirs was not
        starts_off = size == 0 and self._trees == 0 and self._speculated == 1
        if every and (self._speculated % every == 0 or starts_off):
            neighbour = self._neighbour(size, top)
            if size or self._could_pay(neighbour, in_flight, others):
                size, probe = neighbour, True
        return StepChoice(size, curve[size], probe)

    def _could_pay(self, n: int, in_flight: int, others: BatchShare) -> bool:
        """Whether an n-node tree whose every node were accepted (n + 1 tokens) would beat
        plain decoding at the current cost model."""
        if self.batched(in_flight):
            cost = self.shared.batch_cost(others)
            base = others.tokens + 1.0
        else:
            cost = self.shared.time_model(bucket_of(in_flight)).curve()
            base = 1.0
        if cost is None:
            return True
        return (base + n) * cost(0) > base * cost(n)

    def batched(self, in_flight: int) -> bool:
        """Whether the choice now is the batch's (others in flight, V measured per pass)."""
        return in_flight > 1 and self.shared.verify_times is not None

    def _optimum(self, curve: list[float], in_flight: int, others: BatchShare) -> int | None:
        """The best size now; None before the time models can tell (bootstrap).

        Alone: argmax E(n) / T_bucket(n) (ProPD). With others in flight: argmax
        (E_others + E(n)) / T_batch(n), the batch's rate."""
        shared = self.shared
        if self.batched(in_flight):
            cost = shared.batch_cost(others)
            if cost is None:
                return None
            choice = best_size(curve, cost, 0, others.tokens)
        else:
            cost = shared.time_model(bucket_of(in_flight)).curve()
            if cost is None:
                return None
            choice = best_size(curve, cost)
        return choice.size if choice is not None else shared.config.default_size

    def would_speculate(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether a step now would draft (probes and the bootstrap aside), without counting
        as a step: the router prefills a drafter ahead of time only for requests that will use
        it. Before the time model can tell it says no: the bootstrap's few draft steps prefill
        when they draft, rather than every request prefilling every drafter it might be sent
        to."""
        shared = self.shared
        if shared.max_nodes == 0:
            return False
        if not shared.adaptive or shared.length is not None:
            return True
        size = self._optimum(self.profile.expected_tokens(shared.max_nodes), in_flight, others)
        return bool(size)

    def probes_next(self, off: bool) -> bool:
        """Whether the next `choose` is a probe step (`off`: of a request decoding plainly),
        at the probing period; a drafter that must prepare its tree a step ahead (the
        verifier's heads) drafts for it."""
        every = self.shared.probe_every * (OFF_PROBE_SPACING if off else 1)
        return bool(every) and (self._speculated + 1) % every == 0

    def runs_plain(self, in_flight: int, others: BatchShare = BatchShare()) -> bool:
        """Whether the measured costs and this request's profile say no tree of this arm pays
        now (the choice would be 0, probes aside). False while the costs are still being
        bootstrapped and for fixed or Minions-length sizing, which always draft: the
        selection does not explore an arm where the request would only decode plainly."""
        shared = self.shared
        if shared.max_nodes == 0:
            return True
        if not shared.adaptive or shared.length is not None:
            return False
        curve = self.profile.expected_tokens(shared.max_nodes)
        return self._optimum(curve, in_flight, others) == 0

    def _neighbour(self, size: int, top: int) -> int:
        if size == 0:
            return min(OFF_PROBE_SIZE, top)
        # in turn one node more, one less, double, half: the adjacent sizes keep a cost that
        # grows in steps measured around the choice (the int4 kernel takes rows in blocks of
        # 4), double and half the line's slope
        turn = (self._speculated // self.shared.probe_every) % 4
        other = min((size + 1, size - 1, 2 * size, size // 2)[turn], top)
        return other if other != size else size - 1  # at the top: one less

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
            if choice.budget > 0 and draft_seconds > 0:
                # at the size drafted: a confidence-stopped chain runs one forward per node it
                # returns, whatever its budget (a chain asked for 8 that stopped at 3 cost 3
                # levels); timed at the budget, every size looked like the full chain's cost
                shared.draft_times.observe(len(tree) or choice.budget, draft_seconds)
                shared.bootstrap_until = 0  # a bootstrap draft came back
            if shared.length is not None and choice.budget > 0:
                shared.length.observe(step_seconds, [len(emitted) - 1])
            if len(tree):
                self._trees += 1
                self.profile.observe_tree(tree, emitted)
                shared.prior.observe_tree(tree, emitted)
        record = common_pb2.StepDecision(
            step=step, budget=choice.budget, tree_size=len(tree),
            expected_length=choice.expected_length, emitted=len(emitted), seconds=seconds,
            drafters=drafters, probe=choice.probe, arm=arm, switch_seconds=switch_seconds)
        self.decisions.append(record)
        return record
