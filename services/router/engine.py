"""Router engine: the per-request speculative loop, over a pool and a drafter stub.

Step 0 submits an empty tree, so the verifier prefills and emits the first token while the
drafter prefills the prompt concurrently. Each later step asks the draft sources for a tree below
the last token (telling each the tokens accepted since its last call), submits it to the pool,
awaits the verifier's result, and streams the accepted tokens + bonus token out after applying
the stop conditions. The sources (`speculation.source`): the drafter service's model, the
lookup datastore (SSSD), or both, their trees merged into one (a union of their paths). A
failing source never fails the request: the step runs without its tree, and the source is
re-synchronised with the whole context next step (drafter re-prefill, datastore index reset).

How big a tree each step asks for is the policy's (`policy.py`): the configured tree every step
(`speculation.tree_size=fixed`), or per request and step the node budget with the most
expected tokens per second, 0 = this step verifies no tree (adaptive, ProPD). Every step's
decision and outcome is recorded in the request's stats and on its `router.submit` span.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from specmesh_services.common import telemetry
from specmesh_services.common.config import RouterSettings, SpeculationSettings
from specmesh_services.common.drafts import HEADS
from specmesh_services.common.pool import Pool
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.common.text import TextStream
from specmesh_services.common.tree import TokenTree
from specmesh_services.router.arms import DATASTORE_ARM, FIXED_ARM, ArmSet, DraftArm
from specmesh_services.router.batching import MicroBatcher
from specmesh_services.router.policy import RequestSizing, TreeSizing
from specmesh_services.router.selection import Arm, Selection, make_selection
from specmesh_services.router.steps import BatchShare, PassTimes, StepChoice, VerifyStep, bucket_of
from specmesh_services.router.voting import MajorityVoter, Vote, choose_tree
from specmesh_services.router.stats import RequestStats
from specmesh.v1 import common_pb2, datastore_pb2, drafter_pb2, pool_pb2, router_pb2

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


@dataclass(frozen=True)
class TargetInfo:
    """What the router must know of the target model."""

    name: str
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]


class Router:
    def __init__(self, pool: Pool, drafter, tokenizer, target: TargetInfo,
                 speculation: SpeculationSettings, settings: RouterSettings,
                 router_id: str | None = None, drafter_name: str = "", datastore=None,
                 drafter_names: list[str] | None = None,
                 drafter_costs: dict[str, float] | None = None) -> None:
        """`drafter_costs`: seconds of one drafting forward of one request per draft model
        name (the drafter's `DraftModelInfo.level_seconds`), the tree-size policy's estimate of
        a model's drafting cost until the router has timed its drafts."""
        if speculation.source == "auto":
            raise ValueError("speculation.source=auto: resolve it for the model first "
                             "(models.served)")
        if speculation.source != "model" and speculation.depth > 0 and datastore is None:
            raise ValueError(f"speculation.source={speculation.source!r} needs a datastore service")
        self.pool = pool
        self.drafter = drafter  # DrafterStub or LocalStub
        self.datastore = datastore  # DatastoreStub, LocalStub or None
        self.tokenizer = tokenizer
        self.target = target
        self.speculation = speculation
        self.settings = settings
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:12]}"
        # what each arm drafts with, and its limits and costs
        self.arms = ArmSet.build(speculation, drafter_name, drafter_names or [drafter_name],
                                 drafter_costs or {})
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._dispatcher: asyncio.Task | None = None
        self.live: dict[str, int] = {}  # requests being generated -> prompt length
        self.loops: dict[str, _RequestLoop] = {}  # the same requests' loops
        # request -> (tree nodes, expected tokens, drafting seconds) of its current step
        self.plans: dict[str, tuple[int, float, float]] = {}
        # the verifier's pass time over its rows, shared by every arm's sizing
        self.verify_times = PassTimes()
        # micro-batching: the Draft / Lookup calls of loops that are ready together -> one call
        self.drafts = MicroBatcher(
            lambda request, timeout: self.drafter.Draft(request, timeout=timeout),
            lambda items: drafter_pb2.DraftBatchRequest(items=items), settings.draft_batch_max,
            seconds=lambda response, n: response.draft_seconds)
        self.lookups = MicroBatcher(
            lambda request, timeout: self.datastore.Lookup(request, timeout=timeout),
            lambda items: datastore_pb2.LookupBatchRequest(items=items), settings.draft_batch_max,
            seconds=lambda response, n: [response.lookup_seconds / n] * n)
        self.backpressure_waits = 0
        self._sizings: dict[str, TreeSizing] = {}  # per arm: step times, prior acceptance
        # majority vote (Minions 3.2) over every source: the configured arm with selection=fixed,
        # else one more arm for the selection
        self.voter = MajorityVoter(self.arms.voters) if self.arms.voters else None
        self._votes_since_update = 0
        self.selection: Selection | None = None
        if speculation.selection != "fixed" and speculation.depth > 0:
            self.selection = make_selection(
                speculation.selection, [Arm(a.name, a.capacity) for a in self.arms.selectable],
                speculation.slot_s, epsilon=speculation.epsilon)

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def batch_share(self, request_id: str) -> BatchShare:
        """The current plans of the requests in flight other than `request_id`: what its tree
        will share the verifier's step with."""
        nodes, tokens, requests, seconds = 0, 0.0, 0, 0.0
        for other, (size, expected, draft_s) in self.plans.items():
            if other != request_id:
                nodes += size
                tokens += expected
                requests += 1
                seconds += draft_s
        return BatchShare(nodes, tokens, requests, seconds)

    def idle_arm(self, request_id: str, arm: str) -> bool:
        """Whether the request would decode plainly on `arm` now (the selection's `idle`)."""
        loop = self.loops.get(request_id)
        return loop is not None and loop.sizing(arm).runs_plain(self.in_flight,
                                                                self.batch_share(request_id))

    def sizing_for(self, arm: str) -> TreeSizing:
        """The tree-size policy's router-wide state of an arm (drafting costs differ per arm)."""
        if arm not in self._sizings:
            described = self.arms.get(arm)
            self._sizings[arm] = TreeSizing(
                max_nodes=described.max_nodes, max_depth=self.speculation.depth,
                probe_every=self.speculation.probe_every, mode=self.speculation.tree_size,
                verify_times=self.verify_times, draft_prior=described.draft_prior,
                self_sized=described.self_sized)
        return self._sizings[arm]

    def observe_vote(self, vote: Vote, emitted: list[int]) -> None:
        """Credits the voted drafter; weights are updated once per verifier batch's worth of
        outputs (Minions: after each verified batch; the router sees requests, not batches)."""
        self.voter.observe(vote, emitted)
        self._votes_since_update += 1
        if self._votes_since_update >= max(self.in_flight, 1):
            self.voter.update()
            self._votes_since_update = 0

    # result dispatch --------------------------------------------------------------------------
    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"{self.router_id}-results")

    async def stop(self) -> None:
        if self._dispatcher:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)

    async def _dispatch(self) -> None:
        while True:
            try:
                for result in await self.pool.results(self.router_id, block_s=1.0):
                    future = self._waiting.pop((result.request_id, result.step), None)
                    if future is not None and not future.done():
                        future.set_result(result)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep dispatching
                log.exception("reading results failed")
                await asyncio.sleep(0.5)

    # one request ------------------------------------------------------------------------------
    async def generate(self, request: router_pb2.RouteRequest) -> AsyncIterator[router_pb2.RouteChunk]:
        request_id = request.request_id or uuid.uuid4().hex
        prompt = list(request.prompt_ids)
        params = SamplingParams.from_pb(request.sampling)
        self._validate(request, prompt, params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        state = pool_pb2.RequestState(request_id=request_id, prompt_ids=prompt,
                                      sampling=params.to_pb(), seed=seed, model=self.target.name)
        with tracer.start_as_current_span("router.generate") as span:
            span.set_attributes({"specmesh.request_id": request_id,
                                 "specmesh.prompt_tokens": len(prompt)})
            await self.pool.put_request(state, self.settings.request_ttl_s)
            if request_id in self.live:
                raise ValueError(f"request {request_id} is already being generated")
            loop = _RequestLoop(self, request, request_id, prompt)
            self.live[request_id] = len(prompt)
            self.loops[request_id] = loop
            try:
                async for chunk in loop.run():
                    yield chunk
            finally:
                del self.live[request_id]
                del self.loops[request_id]
                self.plans.pop(request_id, None)
                if self.selection is not None:
                    self.selection.release(request_id)
                loop.cancel_prefill()
                span.set_attributes({"specmesh.steps": loop.stats.steps,
                                     "specmesh.mean_accepted_length":
                                         loop.stats.mean_accepted_length})
                await self._release(request_id)

    async def wait_for_room(self) -> None:
        """Back-pressure: while the pool holds `max_pending_trees` trees not yet verified, a new
        tree would only wait there, so drafting pauses (the drafters' time goes to requests
        whose trees will be verified sooner)."""
        limit = self.settings.max_pending_trees
        if not limit:
            return
        waited = False
        deadline = time.monotonic() + self.settings.step_timeout_s
        while await self.pool.pending() >= limit and time.monotonic() < deadline:
            waited = True
            await asyncio.sleep(0.002)
        self.backpressure_waits += waited

    def _validate(self, request: router_pb2.RouteRequest, prompt: list[int],
                  params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if any(not 0 <= t < self.target.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids must be in [0, {self.target.vocab_size})")
        if len(prompt) >= self.target.context_length:
            raise ValueError(f"prompt has {len(prompt)} tokens: the model's context is "
                             f"{self.target.context_length}")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        params.validate()

    async def _release(self, request_id: str) -> None:
        try:
            await self.pool.delete_request(request_id)
            if self.speculation.source != "datastore" and self.drafter is not None:
                await self.drafter.Release(
                    drafter_pb2.DraftReleaseRequest(request_ids=[request_id]))
            if self.datastore is not None and self.speculation.source != "model":
                await self.datastore.Release(
                    datastore_pb2.DatastoreReleaseRequest(request_ids=[request_id]))
        except Exception as err:  # noqa: BLE001 - caches expire or are evicted anyway
            log.warning("releasing %s: %s", request_id, err)

    async def verify(self, request_id: str, step: int, base_len: int,
                     tree: common_pb2.TokenTree, attributes: dict | None = None,
                     heads_nodes: int = 0) -> pool_pb2.VerifyResult:
        """Submits one tree to the pool and waits for its result (with the heads' tree for
        the next step when `heads_nodes`)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[(request_id, step)] = future
        try:
            with tracer.start_as_current_span("router.submit") as span:
                span.set_attributes({"specmesh.step": step, "specmesh.tree_size": len(tree.tokens),
                                     **(attributes or {})})
                entry = pool_pb2.DraftEntry(request_id=request_id, step=step, base_len=base_len,
                                            tree=tree, reply_to=self.router_id,
                                            trace_context=telemetry.inject(),
                                            heads_nodes=heads_nodes)
                await self.pool.submit(entry)
            try:
                result = await asyncio.wait_for(future, self.settings.step_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no verifier answered step {step} of {request_id} within "
                                   f"{self.settings.step_timeout_s:.0f} s: is a verifier running "
                                   f"on this pool?") from None
        finally:
            self._waiting.pop((request_id, step), None)
        if result.error:
            raise RuntimeError(f"verifier rejected step {step}: {result.error}")
        return result


class _DrafterSync:
    """What one model drafter holds of a request: a prefill in flight, tokens it has not seen."""

    def __init__(self, task: asyncio.Task) -> None:
        self.prefill_task: asyncio.Task | None = task
        self.new_tokens: list[int] = []  # emitted since the drafter's last call


class _RequestLoop:
    """State of one request's loop inside the router."""

    def __init__(self, router: Router, request: router_pb2.RouteRequest, request_id: str,
                 prompt: list[int]) -> None:
        self.router = router
        self.request = request
        self.request_id = request_id
        self.prompt = prompt
        self.generated: list[int] = []
        self.stats = RequestStats(prompt_tokens=len(prompt))
        self.text = TextStream(router.tokenizer, list(request.stop))
        self.stops = set(router.target.eos_token_ids) | set(request.stop_token_ids)
        self.max_new = min(request.max_tokens, router.target.context_length - len(prompt))
        self.speculating = router.speculation.depth > 0
        self.sizings: dict[str, RequestSizing] = {}  # per arm
        self.decisions: list[common_pb2.StepDecision] = []
        self.syncs: dict[str, _DrafterSync] = {}  # per model drafter name
        self.lookup_tokens: list[int] = list(prompt)  # not yet sent to the datastore
        self.lookup_reset = True  # the next lookup sends the whole context
        self.vote: Vote | None = None  # this step's vote, when voting
        self.draft_seconds = 0.0  # drafters' time for this step's tree
        # the verifier heads' tree for this step (drafted with the last result) and its time
        self.heads_tree: common_pb2.TokenTree | None = None
        self.heads_seconds = 0.0
        self.switch_seconds = 0.0  # of this step, the wait for a drafter prefill (a switch)

    def sizing(self, arm: str) -> RequestSizing:
        if arm not in self.sizings:
            self.sizings[arm] = self.router.sizing_for(arm).for_request()
        return self.sizings[arm]

    def arm(self) -> DraftArm | None:
        """This step's draft source: the configured one, or the selection's choice."""
        router = self.router
        if router.selection is None:
            return router.arms.configured
        return router.arms.get(router.selection.arm_for(self.request_id, router.live,
                                                        router.idle_arm))

    async def run(self) -> AsyncIterator[router_pb2.RouteChunk]:
        if self.speculating:  # prefill the drafter the first step will use, during step 0
            self._warm(self.arm(), ahead=True)
        step = 0
        while True:
            started = time.perf_counter()
            in_flight = self.router.in_flight
            arm = self.arm() if step > 0 and self.speculating else None
            choice = (self.sizing(arm.name).choose(in_flight,
                                                   self.router.batch_share(self.request_id))
                      if arm else StepChoice(0, 1.0))
            self.router.plans[self.request_id] = (choice.budget, choice.expected_length, 0.0)
            self.draft_seconds = self.switch_seconds = 0.0
            if choice.budget > 0:
                with tracer.start_as_current_span("router.draft", attributes={
                        "specmesh.step": step, "specmesh.budget": choice.budget}):
                    await self.router.wait_for_room()
                    tree_pb = await self._draft(arm, choice.budget)
            else:
                tree_pb = common_pb2.TokenTree()
            tree = TokenTree.from_pb(tree_pb)
            self.router.plans[self.request_id] = (len(tree), choice.expected_length,
                                                  self.draft_seconds)
            drafters = _drafters(tree)
            # the tree's round trip: into the pool, verified, its result back
            with tracer.start_as_current_span("router.verify", attributes={"specmesh.step": step}):
                result = await self.router.verify(
                    self.request_id, step, len(self.generated), tree_pb,
                    {"specmesh.arm": arm.name if arm else "", "specmesh.budget": choice.budget,
                     "specmesh.probe": choice.probe,
                     "specmesh.expected_length": choice.expected_length,
                     "specmesh.drafters": drafters},
                    heads_nodes=self._heads_nodes(choice))
            self.heads_tree = result.heads_tree if result.HasField("heads_tree") else None
            self.heads_seconds = result.heads_seconds
            emitted = [*result.accepted, result.bonus]
            seconds = time.perf_counter() - started
            sizing = self.sizing(arm.name if arm else FIXED_ARM)
            verified = (VerifyStep(result.verify_seconds, result.batch_rows, result.batch_trees,
                                   result.batch_nodes, result.verifier)
                        if result.batch_trees else None)
            self.decisions.append(sizing.observe(
                step, choice, tree, emitted, seconds, in_flight, drafters, arm.name if arm else "",
                verified,
                self.draft_seconds, self.switch_seconds))
            if arm and self.router.selection is not None:
                # SPIN's goodput is the drafter's rate; the switch is a cost of its own (LBSS)
                self.router.selection.observe(self.request_id, arm.name, len(emitted),
                                              max(seconds - self.switch_seconds, 1e-6))
            if self.vote is not None:
                self.router.observe_vote(self.vote, emitted)
                self.vote = None
            self.stats.observe_step(len(tree), len(result.accepted), choice.expected_length)
            trace.get_current_span().add_event("router.step", {
                "specmesh.step": step, "specmesh.arm": arm.name if arm else "", "specmesh.budget":
                    choice.budget, "specmesh.tree_size": len(tree), "specmesh.expected_length":
                    choice.expected_length, "specmesh.emitted": len(emitted)})
            chunk = self._emit(emitted)
            yield chunk
            if chunk.finish_reason:
                return
            for sync in self.syncs.values():
                sync.new_tokens.extend(emitted)
            self.lookup_tokens.extend(emitted)
            if self.router.selection is not None:  # fast switching: prefill where it goes next
                self._warm(self.router.arms.get(self.router.selection.likely_arm(
                    self.request_id)), ahead=True)
            step += 1

    def _emit(self, emitted: list[int]) -> router_pb2.RouteChunk:
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
        if finish:  # the per-step record goes out once, with the last chunk
            stats.decisions.extend(self.decisions)
        return router_pb2.RouteChunk(token_ids=out, text=text, finish_reason=finish,
                                     stats=stats)

    # drafting ---------------------------------------------------------------------------------
    def _heads_nodes(self, choice: StepChoice) -> int:
        """The node limit of the tree the verifier's heads draft with this step's result, for
        the next step: none where that step would not draft with the heads (another arm, or
        a plain step that is not a probe); else the node budget (fixed sizing), or twice this
        step's (at least 2: the adaptive sizing grows it a probe at a time), and no more
        levels than nodes: the heads' time grows with both."""
        router = self.router
        if not (router.arms.heads and self.speculating):
            return 0
        arm = (router.arms.get(router.selection.likely_arm(self.request_id))
               if router.selection is not None else router.arms.configured)
        if arm is None or not arm.heads:
            return 0
        return self.sizing(arm.name).ahead_budget(choice.budget, router.in_flight,
                                                  router.batch_share(self.request_id))

    def _warm(self, arm: DraftArm | None, ahead: bool = False) -> None:
        """Starts the prefill of the arm's drafter models that do not hold this request yet.
        `ahead` (before the arm is used): only if the request's sizing would draft on it now;
        a request whose steps run plain (a saturated batch) costs its drafters nothing."""
        if arm is None or (ahead and not self.sizing(arm.name).would_speculate(
                self.router.in_flight, self.router.batch_share(self.request_id))):
            return
        for name in arm.models:
            if name not in self.syncs and name != HEADS:  # the heads need no prefill
                self.syncs[name] = _DrafterSync(asyncio.create_task(
                    self._prefill_drafter(name, self.prompt + self.generated)))

    async def _prefill_drafter(self, name: str, tokens: list[int]) -> bool:
        try:
            await self.router.drafter.Prefill(drafter_pb2.DraftPrefillRequest(
                request_id=self.request_id, drafter=name, token_ids=tokens),
                timeout=self.router.settings.step_timeout_s)
            return True
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafter prefill of %s failed: %s", self.request_id, _describe(err))
            return False

    async def _draft(self, arm: DraftArm, budget: int) -> common_pb2.TokenTree:
        """A tree of at most `budget` nodes from the arm's sources (fixed sizing: the
        configured tree, as drafted)."""
        self._warm(arm)
        names = list(arm.models)
        parts = [self._draft_model(name, budget) for name in names]
        if arm.datastore:
            parts.append(self._lookup(budget))
            names = [*names, DATASTORE_ARM]
        found = [await parts[0]] if len(parts) == 1 else await asyncio.gather(*parts)
        trees = [TokenTree.from_pb(t) for t in found]
        sizing = self.sizing(arm.name)
        if arm.votes:
            self.vote = self.router.voter.vote(
                {name: _best_path(t) for name, t in zip(names, trees) if len(t)})
            # the voted path; the union when the cost model says its extra nodes are cheap
            cost = sizing.shared.cost(bucket_of(self.router.in_flight))
            per_node = cost.b1 if cost is not None else float("inf")
            tree = choose_tree(self.vote, per_node, self.router.speculation.vote_union_extra_s)
        else:
            tree = trees[0] if len(trees) == 1 else TokenTree.union(trees)
        if sizing.shared.adaptive and len(tree) > budget:
            tree = sizing.profile.prune(tree, budget)  # the nodes worth most
        return tree.to_pb()

    async def _lookup(self, budget: int) -> common_pb2.TokenTree:
        spec = self.router.speculation
        nodes = budget if spec.tree_size != "fixed" else spec.max_nodes
        item = datastore_pb2.LookupItem(request_id=self.request_id, new_tokens=self.lookup_tokens,
                                        max_nodes=nodes, max_depth=spec.depth,
                                        reset=self.lookup_reset)
        try:
            tree, seconds = await self.router.lookups.submit_timed(
                item, self.router.settings.step_timeout_s, alone=self.router.in_flight == 1)
            self.draft_seconds += seconds
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("datastore lookup for %s failed (%s): this step runs without its tree",
                        self.request_id, _describe(err))
            self.lookup_tokens = self.prompt + self.generated
            self.lookup_reset = True
            return common_pb2.TokenTree()
        self.lookup_tokens = []
        self.lookup_reset = False
        return tree

    async def _draft_model(self, name: str, budget: int) -> common_pb2.TokenTree:
        if name == HEADS:  # drafted by the verifier with the last result
            self.draft_seconds += self.heads_seconds
            return self.heads_tree or common_pb2.TokenTree()
        sync = self.syncs[name]
        if sync.prefill_task is not None:
            waited = time.perf_counter()
            ok = await sync.prefill_task
            self.switch_seconds = max(self.switch_seconds, time.perf_counter() - waited)
            sync.prefill_task = None
            if not ok:  # retry with the whole context next step
                self._resync(name)
                return common_pb2.TokenTree()
        spec = self.router.speculation
        # a budget below the depth needs no deeper draft (wider trees are pruned afterwards)
        depth = min(spec.depth, budget) if spec.tree_size != "fixed" else spec.depth
        item = drafter_pb2.DraftItem(request_id=self.request_id, drafter=name,
                                     new_tokens=sync.new_tokens, depth=depth, width=spec.width,
                                     min_probability=spec.min_probability)
        try:
            tree, seconds = await self.router.drafts.submit_timed(
                item, self.router.settings.step_timeout_s, alone=self.router.in_flight == 1)
            self.draft_seconds += seconds
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafting for %s failed (%s): this step runs without a tree",
                        self.request_id, _describe(err))
            self._resync(name)
            return common_pb2.TokenTree()
        sync.new_tokens = []
        return tree

    def _resync(self, name: str) -> None:
        """Re-prefills the drafter with the whole context (after a failed call)."""
        self.syncs[name] = _DrafterSync(asyncio.create_task(
            self._prefill_drafter(name, self.prompt + self.generated)))

    def cancel_prefill(self) -> None:
        for sync in self.syncs.values():
            if sync.prefill_task is not None and not sync.prefill_task.done():
                sync.prefill_task.cancel()


def _best_path(tree: TokenTree) -> list[int]:
    """A tree's most likely path: from the root, the highest-scored child (first if unscored)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(i)
    path, node = [], -1
    while node in children:
        kids = children[node]
        node = max(kids, key=lambda c: tree.scores[c]) if tree.scores else kids[0]
        path.append(tree.tokens[node])
    return path


def _drafters(tree: TokenTree) -> list[str]:
    """Names of the sources whose nodes are in the tree."""
    if not tree.sources:
        return []
    return sorted({tree.source_names[s] for s in tree.sources})


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)):
        return f"{err.code().name}: {err.details()}"
    return repr(err)
