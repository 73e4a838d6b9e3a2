"""One request's speculative loop inside the router: five stages a step.

    plan     which arm drafts and how many nodes (`sizing/`); none on the prefill step
    draft    the arm's sources draft a tree of at most that budget (`drafting.py`)
    submit   the tree goes to the pool; the verifier's result comes back
    observe  sizing, selection, vote, the request's stats and the step's `StepDecision`
    emit     the stop conditions, token by token; the chunk to stream

Step 0 submits an empty tree, so the verifier prefills and emits the first token while the
drafter prefills the prompt concurrently. The loop sees of its router only `LoopServices`.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace

from specmesh_services.common import telemetry
from specmesh_services.common.config import SpeculationSettings
from specmesh_services.common.metrics import RouterMetrics
from specmesh_services.common.text import TextStream
from specmesh_services.router.arms import FIXED_ARM, ArmSet, DraftArm
from specmesh_services.router.batching import MicroBatcher
from specmesh_services.router.drafting import Drafted, DraftStage
from specmesh_services.router.selection import Selection
from specmesh_services.router.sizing import (BatchShare, RequestSizing, StepChoice, TreeSizing,
                                            VerifyStep)
from specmesh_services.router.stats import RequestStats
from specmesh_services.router.voting import BatchedVoter
from specmesh.types import finish_reason_name
from specmesh.v1 import common_pb2, pool_pb2, router_pb2

tracer = telemetry.tracer(__name__)
MAX_PLAIN_RUN = 64  # tokens a plain run decodes at most (plain_tokens' own limit)


@dataclass(frozen=True)
class TargetInfo:
    """What the router must know of the target model."""

    name: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]


class InFlight:
    """The requests a router is generating and the plan of each one's current step: what a
    request's tree will share the verifier's pass with."""

    def __init__(self) -> None:
        self.prompts: dict[str, int] = {}  # request -> prompt length
        self._loops: dict[str, RequestLoop] = {}
        # request -> (tree nodes, expected tokens, drafting seconds) of its current step
        self._plans: dict[str, tuple[int, float, float]] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.prompts

    def add(self, loop: RequestLoop) -> None:
        self.prompts[loop.request_id] = len(loop.prompt)
        self._loops[loop.request_id] = loop

    def remove(self, request_id: str) -> None:
        del self.prompts[request_id]
        del self._loops[request_id]
        self._plans.pop(request_id, None)

    def contexts(self) -> dict[str, int]:
        """Each request's context (prompt + generated tokens), which sizes the prefill a
        request moving to another drafter costs (the selection's `contexts`)."""
        return {rid: len(loop.prompt) + len(loop.generated) for rid, loop in self._loops.items()}

    def plan(self, request_id: str, nodes: int, tokens: float, draft_seconds: float) -> None:
        self._plans[request_id] = (nodes, tokens, draft_seconds)

    def mean_nodes(self) -> float | None:
        """The mean tree size of the current plans (None: none planned)."""
        if not self._plans:
            return None
        return sum(nodes for nodes, _, _ in self._plans.values()) / len(self._plans)

    def share(self, request_id: str) -> BatchShare:
        """The current plans of the requests other than `request_id`."""
        nodes, tokens, requests, seconds = 0, 0.0, 0, 0.0
        for other, (size, expected, draft_s) in self._plans.items():
            if other != request_id:
                nodes += size
                tokens += expected
                requests += 1
                seconds += draft_s
        return BatchShare(nodes, tokens, requests, seconds)

    def idle(self, request_id: str, arm: str) -> bool:
        """Whether the request would decode plainly on `arm` now (the selection's `idle`)."""
        loop = self._loops.get(request_id)
        return loop is not None and loop.sizing(arm).runs_plain(len(self), self.share(request_id))


@dataclass(frozen=True)
class Resumed:
    """A request another router was generating: the tokens the pool holds for it and how
    much of its stream the client already received."""

    generated: list[int]
    sent_tokens: int
    sent_chars: int


@dataclass(frozen=True)
class LoopServices:
    """What a request's loop uses of its router, and nothing else of it."""

    speculation: SpeculationSettings
    step_timeout_s: float
    tokenizer: Any  # decodes the streamed text
    target: TargetInfo
    arms: ArmSet
    batch: InFlight
    sizing_for: Callable[[str], TreeSizing]  # an arm's router-wide sizing, by name
    selection: Selection | None
    voting: BatchedVoter | None
    # submits a tree to the pool and awaits its result (Router.verify)
    verify: Callable[..., Awaitable[pool_pb2.VerifyResult]]
    wait_for_room: Callable[[], Awaitable[None]]  # back-pressure before drafting
    drafter: Any  # the drafter service (its Prefill)
    drafts: MicroBatcher  # the drafter's Draft calls, micro-batched
    lookups: MicroBatcher  # the datastore's Lookup calls, micro-batched
    metrics: RouterMetrics  # the router's Prometheus metrics


@dataclass(frozen=True)
class Plan:
    """What a step will do, decided before it drafts."""

    step: int
    arm: DraftArm | None  # None: no tree (the prefill step, no speculation, no free arm)
    choice: StepChoice
    in_flight: int  # requests in flight when it was planned
    started: float  # perf_counter at its start

    @property
    def arm_name(self) -> str:
        return self.arm.name if self.arm is not None else ""


class RequestLoop:
    """State of one request's loop inside the router."""

    def __init__(self, services: LoopServices, request: router_pb2.RouteRequest,
                 request_id: str, prompt: list[int],
                 sampling: common_pb2.SamplingParams | None = None,
                 resumed: Resumed | None = None) -> None:
        """`sampling`: a sampled request's parameters with its seed, which its draft models
        draw with (coupled drafting); None: they draft their likeliest tokens. `resumed`: the
        request goes on from the pool's tokens, the first chunk holding those its client has
        not received."""
        self.services = services
        self.request_id = request_id
        self.prompt = prompt
        self.generated: list[int] = []
        self.stats = RequestStats(prompt_tokens=len(prompt))
        self.text = TextStream(services.tokenizer, list(request.stop))
        self.backlog: list[int] = []  # generated tokens to stream before the first step
        if resumed is not None:
            self._catch_up(resumed)
        self.stops = set(services.target.eos_token_ids) | set(request.stop_token_ids)
        self.max_new = min(request.max_tokens, services.target.context_length - len(prompt))
        self.speculating = services.speculation.depth > 0
        self.sizings: dict[str, RequestSizing] = {}  # per arm
        self.decisions: list[common_pb2.StepDecision] = []
        self.last_chunk = 0.0  # perf_counter of the last chunk streamed (inter-token latency)
        self.plain_token_seconds = 0.0  # a token of this request's plain runs (EMA; 0: unmeasured)
        self.drafting = DraftStage(services, request_id, lambda: self.prompt + self.generated,
                                   sampling)

    async def run(self) -> AsyncIterator[router_pb2.RouteChunk]:
        if self.backlog:
            chunk = self.emit(self.backlog)
            yield chunk
            if chunk.finish_reason:
                return
            self.drafting.advance(pool_pb2.VerifyResult(), self.backlog)
        if self.speculating:  # prefill the drafter the first step will use, during step 0
            self._warm_ahead(self._arm())
        step = 0
        while True:
            plan = self.plan(step)
            drafted = await self.draft(plan)
            result = await self.submit(plan, drafted)
            # stale: another router applied the step; its tokens were verified, this tree not
            emitted = ([*result.accepted, result.bonus, *result.continued] if result.stale
                       else self.observe(plan, drafted, result))
            chunk = self.emit(emitted)
            yield chunk
            if chunk.finish_reason:
                return
            self.advance(result, emitted)
            step += 1

    def _catch_up(self, resumed: Resumed) -> None:
        """Takes the stream where its client left it: the tokens it received are generated
        and their text handed out; the rest of the pool's tokens wait in `backlog`."""
        received = resumed.generated[:resumed.sent_tokens]
        self.generated = list(received)
        if self.text.stop:
            for token in received:
                self.text.push(token)
        else:
            self.text.extend(received)
        self.text.emitted = min(resumed.sent_chars, len(self.text.text))
        self.backlog = resumed.generated[resumed.sent_tokens:]

    def sizing(self, arm: str) -> RequestSizing:
        """The request's part of an arm's tree-size policy, made at its first use."""
        if arm not in self.sizings:
            self.sizings[arm] = self.services.sizing_for(arm).for_request()
        return self.sizings[arm]

    def close(self) -> None:
        """The request ended: drafter prefills still in flight are cancelled."""
        self.drafting.close()

    # the stages -------------------------------------------------------------------------------
    def plan(self, step: int) -> Plan:
        """The step's arm and node budget, published to the other requests' choices."""
        started = time.perf_counter()
        batch = self.services.batch
        in_flight = len(batch)
        arm = self._arm() if step > 0 and self.speculating else None
        share = self._share(arm) if arm else None
        choice = self.sizing(arm.name).choose(in_flight, share) if arm else StepChoice(0, 1.0)
        # its expected drafting is published with its size: requests planning after it in the
        # same turn (a batch ready together) see the drafting the step already waits for
        expected_draft = (self.sizing(arm.name).shared.draft_seconds(choice.budget)
                          + share.switch_seconds) if choice.budget else 0.0
        batch.plan(self.request_id, choice.budget, choice.expected_length, expected_draft)
        return Plan(step, arm, choice, in_flight, started)

    async def draft(self, plan: Plan) -> Drafted:
        """The plan's tree (none for a budget of 0), after the pool has room for it."""
        budget = plan.choice.budget
        if budget > 0:
            with tracer.start_as_current_span("router.draft", attributes={
                    "specmesh.step": plan.step, "specmesh.budget": budget}):
                await self.services.wait_for_room()
                drafted = await self.drafting.draft(plan.arm, budget, self.sizing(plan.arm.name))
                if drafted.prespeculated:
                    trace.get_current_span().set_attribute("specmesh.prespeculated",
                                                           drafted.prespeculated)
        else:
            drafted = Drafted()
        self.services.batch.plan(self.request_id, len(drafted.tree),
                                 plan.choice.expected_length, drafted.seconds)
        return drafted

    async def submit(self, plan: Plan, drafted: Drafted) -> pool_pb2.VerifyResult:
        """The tree's round trip: into the pool, verified, its result back."""
        choice = plan.choice
        with tracer.start_as_current_span("router.verify", attributes={
                "specmesh.step": plan.step, "specmesh.tree_size": len(drafted.tree),
                "specmesh.sources": list(drafted.tree.source_names),
                "specmesh.prespeculated": drafted.prespeculated or "none"}) as span:
            heads_nodes = self._heads_nodes(choice)
            self.drafting.verifying(drafted, plan.arm)
            result = await self.services.verify(
                self.request_id, plan.step, len(self.generated), drafted.pb,
                {"specmesh.arm": plan.arm_name, "specmesh.budget": choice.budget,
                 "specmesh.probe": choice.probe, "specmesh.expected_length": choice.expected_length,
                 "specmesh.drafters": drafted.drafters},
                heads_nodes=heads_nodes,
                plain_tokens=self._plain_tokens(plan.step, drafted, heads_nodes),
                stop_token_ids=self.stops)
            span.set_attribute("specmesh.accepted", len(result.accepted))
            return result

    def observe(self, plan: Plan, drafted: Drafted, result: pool_pb2.VerifyResult) -> list[int]:
        """What came of the step, learnt by the sizing, the selection and the vote and recorded
        in the request's stats; returns the emitted tokens (accepted + bonus, then the tokens a
        plain step decoded on)."""
        emitted = [*result.accepted, result.bonus, *result.continued]
        seconds = time.perf_counter() - plan.started
        if plan.step and not len(drafted.tree):  # a plain run: its rounds and its round trip
            per_token = seconds / len(emitted)
            self.plain_token_seconds = (per_token if not self.plain_token_seconds else
                                        0.5 * (self.plain_token_seconds + per_token))
        choice, arm, tree = plan.choice, plan.arm_name, drafted.tree
        verified = (VerifyStep(result.verify_seconds, result.batch_rows, result.batch_trees,
                               result.batch_nodes, result.verifier, result.row_seconds,
                               result.turnaround_seconds)
                    if result.batch_trees else None)
        decision = self.sizing(arm or FIXED_ARM).observe(
            plan.step, choice, tree, emitted, seconds, plan.in_flight, drafted.drafters, arm,
            verified, drafted.seconds, drafted.switch_seconds)
        decision.prespeculation = drafted.prespeculated
        self.decisions.append(decision)
        selection = self.services.selection
        if plan.arm is not None and selection is not None:
            # SPIN's goodput is the drafter's rate; the switch is a cost of its own (LBSS)
            selection.observe(self.request_id, arm, len(emitted),
                              max(seconds - drafted.switch_seconds, 1e-6))
        if drafted.vote is not None:
            self.services.voting.observe(drafted.vote, emitted)
        self.stats.observe_step(len(tree), len(result.accepted), choice.expected_length)
        if len(tree):
            self.services.metrics.observe_step(tree, result.accepted)
        elif plan.step:
            self.services.metrics.observe_plain()
        trace.get_current_span().add_event("router.step", {
            "specmesh.step": plan.step, "specmesh.arm": arm, "specmesh.budget": choice.budget,
            "specmesh.tree_size": len(tree), "specmesh.expected_length": choice.expected_length,
            "specmesh.emitted": len(emitted)})
        return emitted

    def emit(self, emitted: list[int]) -> router_pb2.RouteChunk:
        """Applies the stop conditions token by token; returns the chunk to stream."""
        out: list[int] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        by_token = bool(self.text.stop)  # stop sequences are looked for after every token
        for token in emitted:
            out.append(token)
            self.generated.append(token)
            if token in self.stops or (by_token and self.text.push(token)):
                finish = common_pb2.FINISH_REASON_STOP
            elif len(self.generated) >= self.max_new:
                finish = common_pb2.FINISH_REASON_LENGTH
            if finish:
                break
        if not by_token:  # a stop token ends the output but is not text
            self.text.extend(out[:-1] if finish == common_pb2.FINISH_REASON_STOP else out)
        self.stats.observe_emitted(len(out))
        text = self.text.finish() if finish else self.text.take()
        stats = self.stats.to_pb()
        metrics, now = self.services.metrics, time.perf_counter()
        metrics.observe_chunk(len(out), now - self.last_chunk if self.last_chunk else None)
        self.last_chunk = now
        if finish:  # the per-step record goes out once, with the last chunk
            stats.decisions.extend(self.decisions)
            metrics.observe_finished(stats.prompt_tokens, stats.time_to_first_token_s,
                                     stats.total_time_s, finish_reason_name(finish))
        return router_pb2.RouteChunk(token_ids=out, text=text, finish_reason=finish,
                                     stats=stats)

    def advance(self, result: pool_pb2.VerifyResult, emitted: list[int]) -> None:
        """Between two steps: the sources learn the outcome; with a selection, the drafter
        where the request will likely draft next prefills it now (fast switching)."""
        self.drafting.advance(result, emitted)
        selection = self.services.selection
        if selection is not None:
            self._warm_ahead(self.services.arms.get(selection.likely_arm(self.request_id)))

    # arms -------------------------------------------------------------------------------------
    def _arm(self) -> DraftArm | None:
        """This step's draft source: the configured one, or the selection's choice."""
        services = self.services
        if services.selection is None:
            return services.arms.configured
        return services.arms.get(services.selection.arm_for(
            self.request_id, services.batch.prompts, services.batch.idle, services.batch.contexts))

    def _warm_ahead(self, arm: DraftArm | None) -> None:
        """Prefills the arm's drafters before the arm is used, if the request's sizing would
        draft on it now: a request whose steps run plain (a saturated batch) costs its drafters
        nothing."""
        if arm is not None and self.sizing(arm.name).would_speculate(len(self.services.batch),
                                                                     self._share(arm)):
            self.drafting.warm(arm)

    def _share(self, arm: DraftArm) -> BatchShare:
        """The batch as this request's step on `arm` shares it: the others' plans and the
        drafter prefill it would still wait for there."""
        return replace(self.services.batch.share(self.request_id),
                       switch_seconds=self.drafting.switch_seconds(arm))

    def _plain_tokens(self, step: int, drafted: Drafted, heads_nodes: int) -> int:
        """How many tokens a plain step may decode before the verifier answers: `plain_tokens`,
        more while they fit in `plain_run_seconds` at this request's measured plain token
        (fewer round trips a token on fast targets, no longer bursts on slow ones), within the
        request's token limit; one for the first step (its token streams at once), where there
        is a tree, or where the heads draft below this step's bonus."""
        if step == 0 or len(drafted.tree) or heads_nodes:
            return 1
        speculation = self.services.speculation
        runs = speculation.plain_tokens
        if speculation.plain_run_seconds > 0 and self.plain_token_seconds > 0:
            runs = max(runs, min(MAX_PLAIN_RUN,
                                 int(speculation.plain_run_seconds / self.plain_token_seconds)))
        return max(1, min(runs, self.max_new - len(self.generated)))

    def _heads_nodes(self, choice: StepChoice) -> int:
        """The node limit of the tree the verifier's heads draft with this step's result, for
        the next step (`SizeStrategy.ahead_budget`): none where that step would not draft with
        the heads (another arm, or a plain step that is not a probe)."""
        services = self.services
        if not (services.arms.heads and self.speculating):
            return 0
        if services.selection is not None:  # LBSS's likely arm is the next slot's: not enough
            arms = map(services.arms.get, sorted(services.selection.next_arms(self.request_id)))
            arm = next((a for a in arms if a is not None and a.heads), None)
        else:
            arm = services.arms.configured
        if arm is None or not arm.heads:
            return 0
        batch = services.batch
        return self.sizing(arm.name).ahead_budget(choice.budget, len(batch),
                                                  batch.share(self.request_id))
