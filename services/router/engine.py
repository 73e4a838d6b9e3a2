"""Router engine: the per-request speculative loop, over a pool and a drafter stub.

Step 0 submits an empty tree, so the verifier prefills and emits the first token while the
drafter prefills the prompt concurrently. Each later step asks the draft sources for a tree below
the last token (telling each the tokens accepted since its last call), submits it to the pool,
awaits the verifier's result, and streams the accepted tokens + bonus token out after applying
the stop conditions. The sources (`speculation.source`): the drafter service's model, the
lookup datastore (SSSD), or both, their trees merged into one (a union of their paths). A
failing source never fails the request: the step runs without its tree, and the source is
re-synchronised with the whole context next step (drafter re-prefill, datastore index reset).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common import telemetry
from services.common.config import RouterSettings, SpeculationSettings
from services.common.pool import Pool
from services.common.sampling import SamplingParams
from services.common.text import TextStream
from services.router.stats import RequestStats
from services.common.tree import TokenTree
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
                 router_id: str | None = None, drafter_name: str = "", datastore=None) -> None:
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
        self.drafter_name = drafter_name
        self._waiting: dict[tuple[str, int], asyncio.Future] = {}
        self._dispatcher: asyncio.Task | None = None

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
            loop = _RequestLoop(self, request, request_id, prompt)
            try:
                async for chunk in loop.run():
                    yield chunk
            finally:
                loop.cancel_prefill()
                span.set_attributes({"specmesh.steps": loop.stats.steps,
                                     "specmesh.mean_accepted_length":
                                         loop.stats.mean_accepted_length})
                await self._release(request_id)

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
            if self.speculation.source != "datastore":
                await self.drafter.Release(
                    drafter_pb2.DraftReleaseRequest(request_ids=[request_id]))
            if self.datastore is not None and self.speculation.source != "model":
                await self.datastore.Release(
                    datastore_pb2.DatastoreReleaseRequest(request_ids=[request_id]))
        except Exception as err:  # noqa: BLE001 - caches expire or are evicted anyway
            log.warning("releasing %s: %s", request_id, err)

    async def verify(self, request_id: str, step: int, base_len: int,
                     tree: common_pb2.TokenTree) -> pool_pb2.VerifyResult:
        """Submits one tree to the pool and waits for its result."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[(request_id, step)] = future
        try:
            with tracer.start_as_current_span("router.submit") as span:
                span.set_attributes({"specmesh.step": step, "specmesh.tree_size": len(tree.tokens)})
                entry = pool_pb2.DraftEntry(request_id=request_id, step=step, base_len=base_len,
                                            tree=tree, reply_to=self.router_id,
                                            trace_context=telemetry.inject())
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
        source = router.speculation.source
        self.use_model = self.speculating and source in ("model", "both")
        self.use_datastore = self.speculating and source in ("datastore", "both")
        self.prefill_task: asyncio.Task | None = None
        self.new_tokens: list[int] = []  # accepted since the drafter's last call
        self.lookup_tokens: list[int] = list(prompt)  # not yet sent to the datastore
        self.lookup_reset = True  # the next lookup sends the whole context

    async def run(self) -> AsyncIterator[router_pb2.RouteChunk]:
        if self.use_model:
            self.prefill_task = asyncio.create_task(self._prefill_drafter(self.prompt))
        step = 0
        while True:
            tree = await self._draft() if step > 0 else common_pb2.TokenTree()
            result = await self.router.verify(self.request_id, step, len(self.generated), tree)
            self.stats.observe_step(len(tree.tokens), len(result.accepted))
            emitted = [*result.accepted, result.bonus]
            chunk = self._emit(emitted)
            yield chunk
            if chunk.finish_reason:
                return
            self.new_tokens.extend(emitted)
            self.lookup_tokens.extend(emitted)
            step += 1

    def _emit(self, emitted: list[int]) -> router_pb2.RouteChunk:
        """Applies the stop conditions token by token; returns the chunk to stream."""
        out: list[int] = []
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        for token in emitted:
            out.append(token)
            self.generated.append(token)
            if token in self.stops or self.text.push(token):
                finish = common_pb2.FINISH_REASON_STOP
            elif len(self.generated) >= self.max_new:
                finish = common_pb2.FINISH_REASON_LENGTH
            if finish:
                break
        self.stats.observe_emitted(len(out))
        text = self.text.finish() if finish else self.text.take()
        return router_pb2.RouteChunk(token_ids=out, text=text, finish_reason=finish,
                                     stats=self.stats.to_pb())

    # drafting ---------------------------------------------------------------------------------
    async def _prefill_drafter(self, tokens: list[int]) -> bool:
        try:
            await self.router.drafter.Prefill(drafter_pb2.DraftPrefillRequest(
                request_id=self.request_id, drafter=self.router.drafter_name, token_ids=tokens),
                timeout=self.router.settings.step_timeout_s)
            return True
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafter prefill of %s failed: %s", self.request_id, _describe(err))
            return False

    async def _draft(self) -> common_pb2.TokenTree:
        if self.use_model and self.use_datastore:
            model_tree, lookup_tree = await asyncio.gather(self._draft_model(), self._lookup())
            return TokenTree.union([TokenTree.from_pb(model_tree),
                                    TokenTree.from_pb(lookup_tree)]).to_pb()
        if self.use_datastore:
            return await self._lookup()
        if self.use_model:
            return await self._draft_model()
        return common_pb2.TokenTree()

    async def _lookup(self) -> common_pb2.TokenTree:
        spec = self.router.speculation
        item = datastore_pb2.LookupItem(request_id=self.request_id, new_tokens=self.lookup_tokens,
                                        max_nodes=spec.max_nodes, max_depth=spec.depth,
                                        reset=self.lookup_reset)
        try:
            response = await self.router.datastore.Lookup(
                datastore_pb2.LookupBatchRequest(items=[item]),
                timeout=self.router.settings.step_timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("datastore lookup for %s failed (%s): this step runs without its tree",
                        self.request_id, _describe(err))
            self.lookup_tokens = self.prompt + self.generated
            self.lookup_reset = True
            return common_pb2.TokenTree()
        self.lookup_tokens = []
        self.lookup_reset = False
        return response.trees[0]

    async def _draft_model(self) -> common_pb2.TokenTree:
        if self.prefill_task is not None:
            ok = await self.prefill_task
            self.prefill_task = None
            if not ok:  # retry with the whole context next step
                self.prefill_task = asyncio.create_task(
                    self._prefill_drafter(self.prompt + self.generated))
                self.new_tokens = []
                return common_pb2.TokenTree()
        spec = self.router.speculation
        item = drafter_pb2.DraftItem(request_id=self.request_id, drafter=self.router.drafter_name,
                                     new_tokens=self.new_tokens, depth=spec.depth, width=spec.width)
        try:
            response = await self.router.drafter.Draft(drafter_pb2.DraftBatchRequest(items=[item]),
                                                       timeout=self.router.settings.step_timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafting for %s failed (%s): this step runs without a tree",
                        self.request_id, _describe(err))
            self.prefill_task = asyncio.create_task(
                self._prefill_drafter(self.prompt + self.generated))
            self.new_tokens = []
            return common_pb2.TokenTree()
        self.new_tokens = []
        return response.trees[0]

    def cancel_prefill(self) -> None:
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)):
        return f"{err.code().name}: {err.details()}"
    return repr(err)
