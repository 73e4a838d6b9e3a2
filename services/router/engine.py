"""Router engine: the requests' speculative loops over a pool and the draft sources.

The router keeps what its requests share: the pool (each step's tree submitted, its result
dispatched back to the request's loop), the micro-batched drafter and datastore calls, the arms
(`arms.py`) with each arm's tree-size policy (`sizing/`), the drafter selection
(`selection.py`), the majority voter (`voting.py`) and the requests in flight with their plans.
Each request runs as a `RequestLoop` (`loop.py`), which sees of the router only its
`LoopServices`. Sources, tree sizes and what each step records: docs/router.md.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace

from specmesh_services.common import rpc, tasks, telemetry
from specmesh_services.common.config import RouterSettings, SpeculationSettings
from specmesh_services.common.metrics import RouterMetrics
from specmesh_services.common.pool import POOL_DOWN, Pool
from specmesh_services.common.request_checks import check_request
from specmesh_services.common.rpc import FailedPrecondition
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.router.admission import Admission
from specmesh_services.router.arms import ArmSet
from specmesh_services.router.batching import MicroBatcher
from specmesh_services.router.pipeline import micro_batches
from specmesh_services.router.loop import (InFlight, LoopServices, RequestLoop, Resumed,
                                           TargetInfo)
from specmesh_services.router.selection import Arm, Selection, make_selection
from specmesh_services.router.sizing import PassTimes, TreeSizing
from specmesh_services.router.voting import BatchedVoter, MajorityVoter
from specmesh.v1 import common_pb2, datastore_pb2, drafter_pb2, pool_pb2, router_pb2

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

__all__ = ["Router", "TargetInfo"]


CAPACITY_TTL_S = 30.0  # a verifier not heard from this long no longer counts for back-pressure


class Router:
    def __init__(self, pool: Pool, drafter, tokenizer, target: TargetInfo,
                 speculation: SpeculationSettings, settings: RouterSettings,
                 router_id: str | None = None, drafter_name: str = "", datastore=None,
                 drafter_names: list[str] | None = None,
                 drafter_costs: dict[str, float] | None = None,
                 drafter_prefill: dict[str, float] | None = None,
                 pipelined: bool = False, metrics: RouterMetrics | None = None) -> None:
        """`drafter_name`: the model a fixed selection drafts with ("" = the drafter's first);
        `drafter_names`: every model drafter (default: that one); `drafter_costs`: seconds of
        one drafting forward of one request per draft model name (the drafter's
        `DraftModelInfo.level_seconds`), the tree-size policy's estimate of a model's drafting
        cost until the router has timed its drafts; `drafter_prefill`: seconds per context token
        of a prefill per draft model name (`DraftModelInfo.prefill_token_seconds`), the
        selection's switching cost (SPIN eq. 6). `pipelined`: the drafters run beside the
        verifier (their own cores or device), so micro-batches of draft items overlap
        verification (`router.micro_batches` unset: SPIN's heuristic decides how many).
        `metrics`: where its Prometheus metrics go (default: a registry of its own)."""
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
        self.pipelined = pipelined
        # what each arm drafts with, and its limits and costs
        self.arms = ArmSet.build(speculation, drafter_name, drafter_names or [drafter_name],
                                 drafter_costs or {}, drafter_prefill)
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._dispatcher: asyncio.Task | None = None
        self._capacity: dict[str, tuple[int, float]] = {}  # verifier -> (batch size, last seen)
        self.batch = InFlight()  # the requests being generated, their current plans
        # the verifier's pass time over its rows, shared by every arm's sizing
        self.verify_times = PassTimes()
        self._sizings: dict[str, TreeSizing] = {}  # per arm: step times, prior acceptance
        # majority vote (Minions 3.2) over every source: the configured arm with selection=fixed,
        # else one more arm for the selection
        self.voter = MajorityVoter(self.arms.voters) if self.arms.voters else None
        self.selection: Selection | None = None
        if speculation.selection != "fixed" and speculation.depth > 0:
            self.selection = make_selection(
                speculation.selection,
                [Arm(a.name, a.capacity, a.prefill_token_seconds) for a in self.arms.selectable],
                speculation.slot_s, epsilon=speculation.epsilon)
        self.waiting = 0  # requests whose drafting waits for room in the pool
        self.admission = Admission(settings.max_requests, settings.max_waiting,
                                   settings.admission_wait_s)
        self.metrics = metrics or RouterMetrics(model=target.name)
        self.metrics.track(lambda: len(self.batch), lambda: self.waiting + self.admission.waiting)
        self.services = self._loop_services()

    def _loop_services(self) -> LoopServices:
        """What the request loops may use of the router; the Draft / Lookup calls of loops
        that are ready together go out as one call (micro-batching)."""
        batch_max = self.settings.draft_batch_max
        drafts = MicroBatcher(
            lambda request, timeout: self.drafter.Draft(request, timeout=timeout),
            lambda items: drafter_pb2.DraftBatchRequest(items=items), batch_max,
            seconds=lambda response, n: response.draft_seconds, parts=self.micro_batches)
        lookups = MicroBatcher(
            lambda request, timeout: self.datastore.Lookup(request, timeout=timeout),
            lambda items: datastore_pb2.LookupBatchRequest(items=items), batch_max,
            seconds=lambda response, n: [response.lookup_seconds / n] * n)
        voting = (BatchedVoter(self.voter, lambda: len(self.batch)) if self.voter is not None
                  else None)
        return LoopServices(
            speculation=self.speculation, step_timeout_s=self.settings.step_timeout_s,
            tokenizer=self.tokenizer, target=self.target, arms=self.arms, batch=self.batch,
            sizing_for=self.sizing_for, selection=self.selection, voting=voting,
            verify=self.verify, wait_for_room=self.wait_for_room, drafter=self.drafter,
            drafts=drafts, lookups=lookups, metrics=self.metrics)

    def micro_batches(self, items: int) -> int:
        """The calls `items` draft items ready together go out in (SPIN V.B)."""
        if self.settings.micro_batches is not None:
            return self.settings.micro_batches
        if not self.pipelined:
            return 1
        nodes = self.batch.mean_nodes()
        rows = 1 + (nodes if nodes is not None else self.speculation.depth)
        return micro_batches(items, rows, self.verify_times.estimate())

    def sizing_for(self, arm: str) -> TreeSizing:
        """The tree-size policy's router-wide state of an arm (drafting costs differ per arm)."""
        if arm not in self._sizings:
            described = self.arms.get(arm)
            self._sizings[arm] = TreeSizing(
                max_nodes=described.max_nodes, max_depth=self.speculation.depth,
                probe_every=self.speculation.probe_every, mode=self.speculation.tree_size,
                verify_times=self.verify_times, draft_prior=described.draft_prior,
                self_sized=described.self_sized, plain_tokens=self.speculation.plain_tokens)
        return self._sizings[arm]

    # result dispatch --------------------------------------------------------------------------
    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"{self.router_id}-results")

    async def stop(self) -> None:
        if self._dispatcher:
            await tasks.stop([self._dispatcher])

    async def _dispatch(self) -> None:
        while True:
            try:
                for result in await self.pool.results(self.router_id, block_s=1.0):
                    if result.batch_capacity:
                        self._capacity[result.verifier] = (result.batch_capacity,
                                                           time.monotonic())
                    future = self._waiting.pop((result.request_id, result.step), None)
                    if future is not None and not future.done():
                        future.set_result(result)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep dispatching
                log.exception("reading results failed")
                await asyncio.sleep(0.5)

    # one request ------------------------------------------------------------------------------
    async def generate(self, request: router_pb2.RouteRequest, deadline_s: float | None = None
                       ) -> AsyncIterator[router_pb2.RouteChunk]:
        """Generates for `request` once admitted (`admission.py`; `deadline_s`: how long its
        client waits); with `request.resume`, goes on with a request another router was
        generating, from its state in the pool."""
        async with self.admission.slot(deadline_s, resumed=request.HasField("resume")):
            async for chunk in self._generate(request):
                yield chunk

    async def _generate(self, request: router_pb2.RouteRequest
                        ) -> AsyncIterator[router_pb2.RouteChunk]:
        request_id = request.request_id or uuid.uuid4().hex
        resumed = None
        if request.HasField("resume"):
            state, resumed = await self._resumed(request)
        else:
            prompt = list(request.prompt_ids)
            params = SamplingParams.from_pb(request.sampling)
            check_request(prompt, request.max_tokens, params, request.stop,
                          self.target.context_length, self.target.vocab_size)
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            state = pool_pb2.RequestState(request_id=request_id, prompt_ids=prompt,
                                          sampling=params.to_pb(), seed=seed,
                                          model=self.target.name)
        prompt = list(state.prompt_ids)
        with tracer.start_as_current_span("router.generate") as span:
            span.set_attributes({"specmesh.request_id": request_id,
                                 "specmesh.prompt_tokens": len(prompt),
                                 "specmesh.resumed_at": resumed.sent_tokens if resumed else -1})
            if request_id in self.batch:
                raise ValueError(f"request {request_id} is already being generated")
            if resumed is None:
                await self.pool.put_request(state, self.settings.request_ttl_s)
            loop = RequestLoop(self.services, request, request_id, prompt,
                               self._coupling(SamplingParams.from_pb(state.sampling), state.seed),
                               resumed)
            self.batch.add(loop)
            finished = False
            try:
                async for chunk in loop.run():
                    finished = bool(chunk.finish_reason)
                    yield chunk
            finally:
                self.batch.remove(request_id)
                if self.selection is not None:
                    self.selection.release(request_id)
                loop.close()
                span.set_attributes({"specmesh.steps": loop.stats.steps,
                                     "specmesh.mean_accepted_length":
                                         loop.stats.mean_accepted_length})
                # cut by this router's shutdown: the state stays for a router that resumes it
                handed_back = not finished and rpc.draining()
                if handed_back:
                    log.info("handing %s back at %d tokens: the router is stopping", request_id,
                             len(loop.generated))
                await self._release(request_id, keep_state=handed_back)

    async def _resumed(self, request: router_pb2.RouteRequest
                       ) -> tuple[pool_pb2.RequestState, Resumed]:
        """The pool's state of a request to resume and where its client's stream stands."""
        if not request.request_id:
            raise ValueError("resume needs the request_id of the request to go on with")
        found = await self.pool.get_request(request.request_id)
        if found is None:
            raise LookupError(f"request {request.request_id} is not in the pool (it finished, "
                              f"expired or never started): send it again without resume")
        state, generated = found
        if list(state.prompt_ids) != list(request.prompt_ids):
            raise FailedPrecondition(f"request {request.request_id} in the pool has another "
                                     f"prompt: resume repeats the original request")
        sent = request.resume.tokens
        if sent > len(generated):
            raise FailedPrecondition(f"the client received {sent} tokens of request "
                                     f"{request.request_id}, the pool holds {len(generated)}")
        return state, Resumed(generated, sent, request.resume.text_chars)

    def _coupling(self, params: SamplingParams, seed: int) -> common_pb2.SamplingParams | None:
        """How the drafters draw a sampled request's tokens (with its resolved seed: coupled
        drafting, services/drafter/engine.py), or None: they draft their likeliest tokens."""
        if params.greedy or not self.speculation.coupled:
            return None
        return replace(params, seed=seed).to_pb()

    def pending_limit(self) -> int:
        """Trees the pool may hold before drafting pauses: `max_pending_trees`, by default the
        batch sizes of the verifiers that answered within the last CAPACITY_TTL_S summed
        (0 until one has answered: no back-pressure)."""
        if self.settings.max_pending_trees is not None:
            return self.settings.max_pending_trees
        now = time.monotonic()
        for name in [v for v, (_, seen) in self._capacity.items() if now - seen > CAPACITY_TTL_S]:
            del self._capacity[name]
        return sum(size for size, _ in self._capacity.values())

    async def wait_for_room(self) -> None:
        """Back-pressure (Minions): while the pool holds as many trees not yet verified as the
        verifiers batch (`pending_limit`), a new tree would only wait there, so drafting pauses
        (the drafters' time goes to requests whose trees will be verified sooner)."""
        limit = self.pending_limit()
        if not limit:
            return
        deadline = time.monotonic() + self.settings.step_timeout_s
        try:
            if await self.pool.pending() < limit:
                return
            self.waiting += 1
            try:
                while await self.pool.pending() >= limit and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
            finally:
                self.waiting -= 1
        except POOL_DOWN:
            return  # no count to go by: the submit that follows retries until the pool is back

    async def _submit(self, entry: pool_pb2.DraftEntry) -> str:
        """Submits `entry`, retrying with backoff (0.1 s doubling to 2 s) while the pool is
        unreachable (Redis restarting), for at most `step_timeout_s`."""
        deadline, delay = time.monotonic() + self.settings.step_timeout_s, 0.1
        while True:
            try:
                return await self.pool.submit(entry)
            except POOL_DOWN as err:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f"the pool is unreachable: {err}") from err
                log.warning("submitting step %d of %s: %s; retrying in %.1f s", entry.step,
                            entry.request_id, err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _result(self, future: asyncio.Future, entry: pool_pb2.DraftEntry,
                      entry_id: str) -> pool_pb2.VerifyResult:
        """The step's result; meanwhile, every `resubmit_s`, a tree no longer in the pool and
        not answered (lost with a Redis restart) is submitted again. Raises TimeoutError after
        `step_timeout_s`."""
        deadline = time.monotonic() + self.settings.step_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no verifier answered step {entry.step} of "
                                   f"{entry.request_id} within {self.settings.step_timeout_s:.0f}"
                                   f" s: is a verifier running on this pool?")
            try:
                return await asyncio.wait_for(asyncio.shield(future),
                                              min(self.settings.resubmit_s, left))
            except asyncio.TimeoutError:
                pass
            try:
                if not future.done() and not await self.pool.has_entry(entry_id):
                    log.warning("step %d of %s is gone from the pool unanswered: submitting it "
                                "again", entry.step, entry.request_id)
                    entry_id = await self._submit(entry)
            except Exception as err:  # noqa: BLE001 - Redis down: try again next turn
                log.warning("checking step %d of %s: %s", entry.step, entry.request_id, err)

    async def _release(self, request_id: str, keep_state: bool = False) -> None:
        """Frees what the request holds: its state in the pool (and with it the verifiers'
        KV; kept with `keep_state`), the drafter's and the datastore's."""
        try:
            if not keep_state:
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
                     heads_nodes: int = 0, plain_tokens: int = 1,
                     stop_token_ids: Iterable[int] = ()) -> pool_pb2.VerifyResult:
        """Submits one tree to the pool and waits for its result (with the heads' tree for
        the next step when `heads_nodes`; up to `plain_tokens` tokens for an empty tree, ending
        after one of `stop_token_ids`). A stale entry (another router resuming the request
        applied the step first) comes back as `caught_up`'s result: the tokens the pool gained."""
        deadline = time.monotonic() + self.settings.step_timeout_s
        while True:
            future = asyncio.get_running_loop().create_future()
            self._waiting[(request_id, step)] = future
            try:
                with tracer.start_as_current_span("router.submit") as span:
                    span.set_attributes({"specmesh.step": step,
                                         "specmesh.tree_size": len(tree.tokens),
                                         **(attributes or {})})
                    entry = pool_pb2.DraftEntry(request_id=request_id, step=step,
                                                base_len=base_len, tree=tree,
                                                reply_to=self.router_id,
                                                trace_context=telemetry.inject(),
                                                heads_nodes=heads_nodes,
                                                plain_tokens=plain_tokens)
                    if plain_tokens > 1:
                        entry.stop_token_ids.extend(sorted(stop_token_ids))
                    entry_id = await self._submit(entry)
                result = await self._result(future, entry, entry_id)
            finally:
                self._waiting.pop((request_id, step), None)
            if result.error:
                raise RuntimeError(f"verifier rejected step {step}: {result.error}")
            if not result.stale:
                return result
            caught_up = await self.caught_up(request_id, step, base_len)
            if caught_up is not None:
                return caught_up
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} of {request_id} stayed stale for "
                                   f"{self.settings.step_timeout_s:.0f} s")
            await asyncio.sleep(0.05)  # the pool is back at base_len: the step goes again

    async def caught_up(self, request_id: str, step: int, base_len: int
                        ) -> pool_pb2.VerifyResult | None:
        """The tokens the pool holds for the request beyond `base_len`, as a stale result
        (accepted + bonus; nothing was verified for this router); None if it holds none more."""
        found = await self.pool.get_request(request_id)
        if found is None:
            raise LookupError(f"request {request_id} is gone from the pool")
        tokens = found[1]
        if len(tokens) < base_len:
            raise RuntimeError(f"the pool holds {len(tokens)} tokens of {request_id}, fewer than "
                               f"the {base_len} streamed: it lost writes (Redis without "
                               f"persistence?)")
        if len(tokens) == base_len:
            return None
        log.info("step %d of %s was applied elsewhere: catching up %d tokens", step, request_id,
                 len(tokens) - base_len)
        return pool_pb2.VerifyResult(request_id=request_id, step=step, base_len=base_len,
                                     accepted=tokens[base_len:-1], bonus=tokens[-1], stale=True)
