"""The draft stage of a request's loop: the step's arm's sources draft a tree of at most the
step's budget, merged into one (a union of their paths) or majority-voted, pruned to the budget.

The sources: the drafter service's models (each prefilled with the request's context, then told
the tokens emitted since its last call), the lookup datastore (SSSD; told the same), and the
verifier's draft heads (their tree for this step came with the last result). A failing source
never fails the request: the step runs without its tree, and the source is re-synchronised
with the whole context (drafter re-prefill, datastore index reset).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import grpc

from specmesh_services.common import telemetry
from specmesh_services.common.drafts import HEADS
from specmesh_services.common.tree import TokenTree
from specmesh_services.router.arms import DATASTORE_ARM, DraftArm
from specmesh_services.router.sizing import RequestSizing, bucket_of
from specmesh_services.router.voting import Vote, choose_tree
from specmesh.v1 import common_pb2, datastore_pb2, drafter_pb2, pool_pb2

if TYPE_CHECKING:
    from specmesh_services.router.loop import LoopServices

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


@dataclass
class Drafted:
    """A step's tree and what drafting it took."""

    pb: common_pb2.TokenTree = field(default_factory=common_pb2.TokenTree)
    seconds: float = 0.0  # the drafters' time for it
    switch_seconds: float = 0.0  # of the step, the wait for a drafter's prefill (a switch)
    vote: Vote | None = None  # the vote it is the outcome of, when voting
    # "hit": drafted during the step before's verification; "miss": one was, under another
    # outcome; "": none was
    prespeculated: str = ""
    tree: TokenTree = field(init=False)
    drafters: list[str] = field(init=False)  # the sources whose nodes are in it

    def __post_init__(self) -> None:
        self.tree = TokenTree.from_pb(self.pb)
        self.drafters = (sorted({self.tree.source_names[s] for s in self.tree.sources})
                         if self.tree.sources else [])


class _Sourced(NamedTuple):
    """One source's tree for a step."""

    tree: common_pb2.TokenTree
    seconds: float = 0.0
    switch_seconds: float = 0.0
    prespeculated: str = ""


@dataclass
class _Ahead:
    """A model's tree drafted while the step before is verified, under the outcome "its whole
    main path accepted": the drafter holds the path, the tree's root is the path's last token,
    its first level the bonus tokens hypothesised, each with the next step's tree below it."""

    model: str
    path: list[int]
    task: asyncio.Task  # -> _Sourced, or None when the call failed
    came_true: bool | None = None  # the path accepted (None: the outcome is not known yet)
    bonus: int = -1


class _DrafterSync:
    """What one model drafter holds of a request: a prefill in flight, tokens it has not seen."""

    def __init__(self, task: asyncio.Task) -> None:
        self.prefill_task: asyncio.Task | None = task
        self.new_tokens: list[int] = []  # emitted since the drafter's last call


class DraftStage:
    """One request's draft sources and what each holds of it. `context()`: the request's
    tokens so far (prompt, then generated).

    Pre-speculation (`speculation.prespeculate`): when a step's tree goes to the verifier
    (`verifying`), its draft model drafts the next tree at once under the outcome "the whole
    main path accepted" (one hypothesis per request, keyed by the accepted count, the path,
    and the bonus token, its root's children). `advance` learns the outcome; the next `draft`
    takes the hypothesis's subtree below the real bonus when it came true (a hit), else drafts
    as before, the drafter rolling back what it committed ahead (`DraftItem.context_len`).
    The verifier's heads draft ahead too (the next step's tree comes with each result)."""

    def __init__(self, services: LoopServices, request_id: str,
                 context: Callable[[], list[int]],
                 sampling: common_pb2.SamplingParams | None = None) -> None:
        self.services = services
        self.sampling = sampling  # a sampled request's, for coupled drafting (None: greedy)
        self.request_id = request_id
        self.context = context
        self.syncs: dict[str, _DrafterSync] = {}  # per model drafter name
        self.lookup_tokens: list[int] = context()  # not yet sent to the datastore
        self.lookup_reset = True  # the next lookup sends the whole context
        # the verifier heads' tree for the next step (drafted with the last result), its time
        self.heads_tree: common_pb2.TokenTree | None = None
        self.heads_seconds = 0.0
        self.ahead: _Ahead | None = None
        self.depth = 0  # the depth the last model draft asked for

    def warm(self, arm: DraftArm) -> None:
        """Starts the prefill of the arm's drafter models that do not hold the request yet."""
        for name in arm.models:
            if name not in self.syncs and name != HEADS:  # the heads need no prefill
                self._prefill(name)

    def switch_seconds(self, arm: DraftArm) -> float:
        """The prefill a tree of `arm` would still wait for: the request's whole context at the
        arm's measured prefill rate while one of its models does not hold the request yet (a
        prefill not started, or still running), else 0."""
        pending = any(name != HEADS and (name not in self.syncs or (
            self.syncs[name].prefill_task is not None and not self.syncs[name].prefill_task.done()))
            for name in arm.models)
        return arm.prefill_token_seconds * len(self.context()) if pending else 0.0

    async def draft(self, arm: DraftArm, budget: int, sizing: RequestSizing) -> Drafted:
        """A tree of at most `budget` nodes from the arm's sources (fixed sizing: the
        configured tree, as drafted)."""
        self.warm(arm)
        names = list(arm.models)
        parts = [self._draft_model(name, budget, sizing) for name in names]
        if arm.datastore:
            parts.append(self._lookup(budget, sizing))
            names.append(DATASTORE_ARM)
        found = [await parts[0]] if len(parts) == 1 else await asyncio.gather(*parts)
        trees = [TokenTree.from_pb(part.tree) for part in found]
        vote = None
        if arm.votes:
            vote = self.services.voting.vote(
                {name: _best_path(t) for name, t in zip(names, trees) if len(t)})
            tree = self._voted(vote, sizing)
        else:
            tree = trees[0] if len(trees) == 1 else TokenTree.union(trees)
        if sizing.shared.adaptive and len(tree) > budget:
            tree = sizing.profile.prune(tree, budget)  # the nodes worth most
        return Drafted(tree.to_pb(), sum(part.seconds for part in found),
                       max(part.switch_seconds for part in found), vote,
                       max(part.prespeculated for part in found))

    def verifying(self, drafted: Drafted, arm: DraftArm | None) -> None:
        """The step's tree goes to the verifier: with pre-speculation, the arm's draft model
        drafts the next tree under "the whole main path accepted" meanwhile."""
        name = arm.one_model if arm is not None else None
        sync = self.syncs.get(name) if name is not None else None
        if (not self.services.speculation.prespeculate or sync is None
                or sync.prefill_task is not None or self.ahead is not None):
            return
        path = _best_path(drafted.tree)
        if not path:
            return
        # the tokens it was not told yet, then the path; one level more (its first: the bonus
        # token's), within the drafter's 64
        item = self._draft_item(name, sync.new_tokens + path, min(self.depth + 1, 64),
                                context_len=len(self.context()) - len(sync.new_tokens))
        sync.new_tokens = []
        self.ahead = _Ahead(name, path, asyncio.create_task(self._submit(item)))

    def advance(self, result: pool_pb2.VerifyResult, emitted: list[int]) -> None:
        """The step's outcome: the sources are told the emitted tokens (accepted + bonus) at
        their next call, and the heads' tree for the next step is kept. A drafter that drafted
        ahead holds the main path: told only the bonus when the path was accepted."""
        self.heads_tree = result.heads_tree if result.HasField("heads_tree") else None
        self.heads_seconds = result.heads_seconds
        ahead = self.ahead
        held = 0  # tokens of `emitted` the drafter that drafted ahead already holds
        if ahead is not None and ahead.came_true is None:
            ahead.came_true = list(result.accepted) == ahead.path
            ahead.bonus = result.bonus
            held = len(ahead.path) if ahead.came_true else 0
        model = ahead.model if ahead is not None else None
        for name, sync in self.syncs.items():
            sync.new_tokens.extend(emitted[held:] if name == model else emitted)
        self.lookup_tokens.extend(emitted)

    def close(self) -> None:
        """Cancels the drafters' prefills of the request still in flight, and a draft ahead."""
        for sync in self.syncs.values():
            if sync.prefill_task is not None and not sync.prefill_task.done():
                sync.prefill_task.cancel()
        if self.ahead is not None:
            self.ahead.task.cancel()

    def _voted(self, vote: Vote, sizing: RequestSizing) -> TokenTree:
        """The voted path; the union when the cost model says its extra nodes are cheap."""
        cost = sizing.shared.cost(bucket_of(len(self.services.batch)))
        per_node = cost.b1 if cost is not None else math.inf
        return choose_tree(vote, per_node, self.services.speculation.vote_union_extra_s)

    # model drafters ---------------------------------------------------------------------------
    def _prefill(self, name: str) -> None:
        """(Re)starts the drafter's prefill of the request with its whole context."""
        self.syncs[name] = _DrafterSync(asyncio.create_task(
            self._prefill_drafter(name, self.context())))

    def _prefill_request(self, name: str, tokens: list[int]) -> drafter_pb2.DraftPrefillRequest:
        request = drafter_pb2.DraftPrefillRequest(request_id=self.request_id, drafter=name,
                                                  token_ids=tokens)
        if self.sampling is not None:
            request.sampling.CopyFrom(self.sampling)
            request.target_vocab_size = self.services.target.vocab_size
        return request

    def _draft_item(self, name: str, new_tokens: list[int], depth: int,
                    context_len: int | None = None) -> drafter_pb2.DraftItem:
        """`context_len`: the request's tokens the new ones follow (default: the context
        without them; drafting ahead, without those not emitted yet either)."""
        spec = self.services.speculation
        if context_len is None:
            context_len = len(self.context()) - len(new_tokens)
        return drafter_pb2.DraftItem(request_id=self.request_id, drafter=name,
                                     new_tokens=new_tokens, depth=depth, width=spec.width,
                                     min_probability=spec.min_probability,
                                     context_len=context_len)

    async def _submit(self, item: drafter_pb2.DraftItem) -> _Sourced | None:
        """A tree drafted ahead (None when the call failed: the drafter is then re-prefilled
        before its next call)."""
        try:
            # a child of the step's router.verify span: drafting while its tree is verified
            with tracer.start_as_current_span("router.draft_ahead", attributes={
                    "specmesh.depth": item.depth, "specmesh.path": len(item.new_tokens)}):
                tree, seconds = await self.services.drafts.submit_timed(
                    item, self.services.step_timeout_s, alone=len(self.services.batch) == 1)
            return _Sourced(tree, seconds)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafting ahead for %s failed: %s", self.request_id, _describe(err))
            return None

    async def _settle_ahead(self, name: str) -> tuple[_Sourced | None, _Ahead | None]:
        """Waits for the model's tree drafted ahead (the drafter takes calls in order) and
        forgets it; returns it with its hypothesis, or (None, None) when there is none. A
        failed one leaves the drafter re-prefilling."""
        ahead = self.ahead
        if ahead is None or ahead.model != name:
            return None, None
        self.ahead = None
        try:
            sourced = await ahead.task
        except asyncio.CancelledError:
            sourced = None
        if sourced is None:
            self._prefill(name)
        return sourced, ahead

    async def _prefill_drafter(self, name: str, tokens: list[int]) -> bool:
        try:
            await self.services.drafter.Prefill(self._prefill_request(name, tokens),
                                                timeout=self.services.step_timeout_s)
            return True
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafter prefill of %s failed: %s", self.request_id, _describe(err))
            return False

    async def _draft_model(self, name: str, budget: int, sizing: RequestSizing) -> _Sourced:
        if name == HEADS:  # drafted by the verifier with the last result
            return _Sourced(self.heads_tree or common_pb2.TokenTree(), self.heads_seconds)
        sourced, hypothesis = await self._settle_ahead(name)
        if sourced is not None and hypothesis.came_true:
            tree = TokenTree.from_pb(sourced.tree)
            below = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))
                          if p < 0 and t == hypothesis.bonus), None)
            below = tree.subtree(below) if below is not None else TokenTree()
            if len(below):  # the outcome drafted ahead came true: its next tree
                return _Sourced(below.to_pb(), sourced.seconds, 0.0, "hit")
        missed = "miss" if hypothesis is not None else ""
        sync, switch = self.syncs[name], 0.0
        if sync.prefill_task is not None:
            waited = time.perf_counter()
            ok = await sync.prefill_task
            switch = time.perf_counter() - waited
            sync.prefill_task = None
            if not ok:  # retry with the whole context next step
                self._prefill(name)
                return _Sourced(common_pb2.TokenTree(), 0.0, switch, missed)
        spec = self.services.speculation
        # a budget below the depth needs no deeper draft (wider trees are pruned afterwards)
        depth = self.depth = min(spec.depth, budget) if sizing.shared.adaptive else spec.depth
        try:
            tree, seconds = await self.services.drafts.submit_timed(
                self._draft_item(name, sync.new_tokens, depth), self.services.step_timeout_s,
                alone=len(self.services.batch) == 1)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("drafting for %s failed (%s): this step runs without a tree",
                        self.request_id, _describe(err))
            self._prefill(name)  # re-prefilled with the whole context
            return _Sourced(common_pb2.TokenTree(), 0.0, switch, missed)
        sync.new_tokens = []
        return _Sourced(tree, seconds, switch, missed)

    # the datastore ----------------------------------------------------------------------------
    async def _lookup(self, budget: int, sizing: RequestSizing) -> _Sourced:
        spec = self.services.speculation
        nodes = budget if sizing.shared.adaptive else spec.max_nodes
        item = datastore_pb2.LookupItem(request_id=self.request_id, new_tokens=self.lookup_tokens,
                                        max_nodes=nodes, max_depth=spec.depth,
                                        reset=self.lookup_reset)
        try:
            tree, seconds = await self.services.lookups.submit_timed(
                item, self.services.step_timeout_s, alone=len(self.services.batch) == 1)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("datastore lookup for %s failed (%s): this step runs without its tree",
                        self.request_id, _describe(err))
            self.lookup_tokens = self.context()
            self.lookup_reset = True
            return _Sourced(common_pb2.TokenTree())
        self.lookup_tokens = []
        self.lookup_reset = False
        return _Sourced(tree, seconds)


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


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)):
        return f"{err.code().name}: {err.details()}"
    return repr(err)
