"""In-memory stand-ins for what a router talks to, for tests of its request loop in milliseconds.

Every request continues its prompt in a made-up language (`next_token`); the scripted
verifier accepts the longest drafted path that follows it and adds the next token as the
bonus, as a lossless verifier over that language would. The drafter and the datastore draft
chains in the same language, right for their first `correct` tokens, and check that the
context the router kept them in step with is the request's real one. Calls fail on demand.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from contextlib import asynccontextmanager

import grpc

from specmesh_services.common.config import RouterSettings, SpeculationSettings
from specmesh_services.common.tree import TokenTree
from specmesh_services.router.engine import Router, TargetInfo
from specmesh.v1 import datastore_pb2, drafter_pb2, pool_pb2

VOCAB = 64
EOS = 0


def next_token(context: list[int]) -> int:
    """The language: every token follows from the two before it (never EOS)."""
    return (7 * context[-1] + 3 * context[-2] + 11) % 40 + 10


def continuation(prompt: list[int], n: int) -> list[int]:
    """The first n tokens the target generates after `prompt`."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def chain(context: list[int], depth: int, correct: int | None, source: str) -> TokenTree:
    """A drafted chain of `depth` tokens, right for its first `correct` (None: all)."""
    tokens = list(context)
    for i in range(depth):
        token = next_token(tokens)
        tokens.append(token if correct is None or i < correct else token % 40 + 11)
    drafted = tokens[len(context):]
    return TokenTree.chain(drafted, [0.9 ** (i + 1) for i in range(len(drafted))], source)


def rpc_error(code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted failure")


def record(calls: list, request, fail: set[int]) -> None:
    """Records a call; the calls numbered in `fail` (1 = the first) raise an RPC error."""
    calls.append(request)
    if len(calls) in fail:
        raise rpc_error()


class WordTokenizer:
    """Token t reads "<t>": a stop string of whole tokens matches nowhere else."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakePool:
    """The `Pool` methods a router uses, in memory; the verifier takes from `queue`."""

    def __init__(self) -> None:
        self.states: dict[str, pool_pb2.RequestState] = {}
        self.deleted: list[str] = []
        self.queue: asyncio.Queue[pool_pb2.DraftEntry] = asyncio.Queue()
        self.verifying = 0
        self._results: dict[str, list[pool_pb2.VerifyResult]] = defaultdict(list)
        self._arrived: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._ids = itertools.count()

    async def put_request(self, state: pool_pb2.RequestState, ttl_s: float) -> None:
        self.states[state.request_id] = state

    async def delete_request(self, request_id: str) -> None:
        self.deleted.append(request_id)

    async def submit(self, entry: pool_pb2.DraftEntry) -> str:
        copy = pool_pb2.DraftEntry()
        copy.CopyFrom(entry)
        self.queue.put_nowait(copy)
        return f"{next(self._ids)}-0"

    async def pending(self) -> int:
        return self.queue.qsize() + self.verifying

    async def has_entry(self, entry_id: str) -> bool:
        return True  # nothing is lost here

    async def results(self, router_id: str, block_s: float) -> list[pool_pb2.VerifyResult]:
        arrived = self._arrived[router_id]
        if not self._results[router_id]:
            try:
                await asyncio.wait_for(arrived.wait(), block_s)
            except asyncio.TimeoutError:
                return []
        arrived.clear()
        out, self._results[router_id] = self._results[router_id], []
        return out

    def publish(self, router_id: str, result: pool_pb2.VerifyResult) -> None:
        self._results[router_id].append(result)
        self._arrived[router_id].set()


class ScriptedVerifier:
    """Verifies the pool's entries against the language, one at a time."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.generated: dict[str, list[int]] = defaultdict(list)  # what the pool appended
        self.entries: list[pool_pb2.DraftEntry] = []
        self.batch_capacity = 4  # the batch size its results report

    def context(self, request_id: str) -> list[int]:
        return list(self.pool.states[request_id].prompt_ids) + self.generated[request_id]

    async def run(self) -> None:
        while True:
            entry = await self.pool.queue.get()
            self.pool.verifying += 1
            await asyncio.sleep(0)  # the forward pass
            self.pool.verifying -= 1
            self.entries.append(entry)
            self.pool.publish(entry.reply_to, self.verify(entry))

    def verify(self, entry: pool_pb2.DraftEntry) -> pool_pb2.VerifyResult:
        generated = self.generated[entry.request_id]
        assert entry.base_len == len(generated), "the router's count of generated tokens"
        context = self.context(entry.request_id)
        tree = TokenTree.from_pb(entry.tree)
        accepted, nodes, node = [], [], -1
        while True:  # the longest drafted path the target follows
            want = next_token(context + accepted)
            child = next((i for i, parent in enumerate(tree.parents)
                          if parent == node and tree.tokens[i] == want), None)
            if child is None:
                break
            accepted.append(want)
            nodes.append(child)
            node = child
        bonus = next_token(context + accepted)
        generated.extend([*accepted, bonus])
        rows = len(tree) + 1 + (len(context) if entry.step == 0 else 0)
        return pool_pb2.VerifyResult(
            request_id=entry.request_id, step=entry.step, base_len=entry.base_len,
            accepted=accepted, accepted_nodes=nodes, bonus=bonus, tree_size=len(tree),
            verifier="scripted", verify_seconds=0.001 * rows, batch_trees=1,
            batch_nodes=len(tree), batch_rows=rows, batch_capacity=self.batch_capacity)


class ScriptedDrafter:
    """Drafter service stub: per model, chains right for their first `correct[model]` tokens;
    `fail_drafts` / `fail_prefills`: which calls (1 = the first) raise an RPC error."""

    def __init__(self, verifier: ScriptedVerifier, correct: dict[str, int | None] | None = None,
                 fail_drafts: set[int] = frozenset(), fail_prefills: set[int] = frozenset()
                 ) -> None:
        self.verifier = verifier
        self.correct = correct or {}
        self.fail_drafts, self.fail_prefills = set(fail_drafts), set(fail_prefills)
        self.contexts: dict[tuple[str, str], list[int]] = {}  # (request, model) -> tokens held
        self.prefills: list[drafter_pb2.DraftPrefillRequest] = []
        self.batches: list[drafter_pb2.DraftBatchRequest] = []
        self.released: list[str] = []

    async def Prefill(self, request: drafter_pb2.DraftPrefillRequest, timeout: float):
        record(self.prefills, request, self.fail_prefills)
        self.contexts[request.request_id, request.drafter] = list(request.token_ids)
        return drafter_pb2.DraftPrefillResponse(context_len=len(request.token_ids))

    async def Draft(self, batch: drafter_pb2.DraftBatchRequest, timeout: float):
        record(self.batches, batch, self.fail_drafts)
        trees = []
        for item in batch.items:
            context = self.contexts[item.request_id, item.drafter]
            if item.context_len:  # rolls back tokens committed ahead that did not come true
                assert len(context) >= item.context_len, "the call follows tokens never held"
                del context[item.context_len:]
            context.extend(item.new_tokens)
            real = self.verifier.context(item.request_id)  # ahead: the context runs past it
            assert context[:len(real)] == real[:len(context)], "drafter out of step"
            trees.append(chain(context, item.depth, self.correct.get(item.drafter, 2),
                               item.drafter or "model").to_pb())
        return drafter_pb2.DraftBatchResponse(trees=trees,
                                              draft_seconds=[0.001] * len(trees))

    async def Release(self, request: drafter_pb2.DraftReleaseRequest):
        self.released.extend(request.request_ids)
        return drafter_pb2.DraftReleaseResponse(released=len(request.request_ids))


class ScriptedDatastore:
    """Lookup service stub: chains of min(max_nodes, max_depth) tokens, right for `correct`;
    an unknown request without `reset` fails as the service does."""

    def __init__(self, verifier: ScriptedVerifier, correct: int | None = 3,
                 fail_lookups: set[int] = frozenset()) -> None:
        self.verifier = verifier
        self.correct = correct
        self.fail_lookups = set(fail_lookups)
        self.contexts: dict[str, list[int]] = {}
        self.batches: list[datastore_pb2.LookupBatchRequest] = []
        self.released: list[str] = []

    async def Lookup(self, batch: datastore_pb2.LookupBatchRequest, timeout: float):
        record(self.batches, batch, self.fail_lookups)
        trees = []
        for item in batch.items:
            if item.reset:
                self.contexts[item.request_id] = []
            elif item.request_id not in self.contexts:
                raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION)
            context = self.contexts[item.request_id]
            context.extend(item.new_tokens)
            assert context == self.verifier.context(item.request_id), "index out of step"
            trees.append(chain(context, min(item.max_nodes, item.max_depth), self.correct,
                               "datastore").to_pb())
        return datastore_pb2.LookupBatchResponse(trees=trees, lookup_seconds=0.0005)

    async def Release(self, request: datastore_pb2.DatastoreReleaseRequest):
        self.released.extend(request.request_ids)
        return datastore_pb2.DatastoreReleaseResponse(released=len(request.request_ids))


class Mesh:
    """A router over the fakes; `drafter` and `datastore` are built from the verifier."""

    def __init__(self, speculation: SpeculationSettings, drafter_names: list[str] | None = None,
                 drafter: dict | None = None, datastore: dict | None = None,
                 drafter_prefill: dict[str, float] | None = None,
                 router: dict | None = None, pipelined: bool = False,
                 drafter_costs: dict[str, float] | None = None) -> None:
        self.pool = FakePool()
        self.verifier = ScriptedVerifier(self.pool)
        self.drafter = ScriptedDrafter(self.verifier, **(drafter or {}))
        self.datastore = ScriptedDatastore(self.verifier, **(datastore or {}))
        self.router = Router(
            self.pool, self.drafter, WordTokenizer(), TargetInfo("t", VOCAB, 4096, (EOS,)),
            speculation, RouterSettings(**{"step_timeout_s": 5.0, **(router or {})}),
            datastore=self.datastore,
            drafter_name=(drafter_names or [""])[0], drafter_names=drafter_names,
            drafter_prefill=drafter_prefill, pipelined=pipelined, drafter_costs=drafter_costs)


@asynccontextmanager
async def running(mesh: Mesh):
    """The router's result dispatch and the verifier, running."""
    verifier = asyncio.create_task(mesh.verifier.run())
    mesh.router.start()
    try:
        yield mesh
    finally:
        await mesh.router.stop()
        verifier.cancel()
        await asyncio.gather(verifier, return_exceptions=True)
