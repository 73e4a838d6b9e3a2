"""Verifier engine: per-request target KV caches, prefill, one-pass tree verification, rollback.

Plain Python over torch (no gRPC, no Redis): the worker feeds it entries from the pool, the
servicer from RPCs, tests call it directly. Cache convention: rows hold every token of the
request except the last one (the root of the next tree), so a step runs "root + tree" in one
forward pass and keeps the root's and the accepted nodes' rows.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from services.common.lm import CausalLM, KVCache
from services.common.sampling import Sampler, SamplingParams
from services.common.tree import TokenTree, compile_tree
from services.verifier.walk import WalkResult, walk
from specmesh.v1 import pool_pb2

log = logging.getLogger(__name__)


@dataclass
class RequestKV:
    """A request as the verifier holds it."""

    state: pool_pb2.RequestState
    sampler: Sampler
    cache: KVCache  # rows for tokens[:-1]
    tokens: list[int]  # prompt + generated

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.state.prompt_ids)


@dataclass(frozen=True)
class StepOutcome:
    walk: WalkResult
    tree_size: int
    seconds: float


class VerifierEngine:
    def __init__(self, lm: CausalLM, name: str = "verifier") -> None:
        self.lm = lm
        self.name = name
        self.requests: dict[str, RequestKV] = {}

    # request lifecycle ------------------------------------------------------------------------
    def ready_for(self, request_id: str, base_len: int) -> bool:
        """Whether the cache of `request_id` is at exactly `base_len` generated tokens."""
        req = self.requests.get(request_id)
        return req is not None and req.generated == base_len

    def load(self, state: pool_pb2.RequestState, generated: list[int]) -> None:
        """(Re)builds a request's cache by prefilling prompt + generated (all but the last token)."""
        tokens = list(state.prompt_ids) + list(generated)
        if not tokens:
            raise ValueError(f"request {state.request_id} has an empty prompt")
        cache = self.lm.new_cache()
        self.lm.prefill(cache, tokens[:-1])
        sampler = Sampler(SamplingParams.from_pb(state.sampling), state.seed)
        self.requests[state.request_id] = RequestKV(state, sampler, cache, tokens)

    def release(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    # verification -----------------------------------------------------------------------------
    def verify(self, request_id: str, tree: TokenTree) -> StepOutcome:
        """Verifies `tree` below the request's last token; commits the accepted path + bonus."""
        start = time.perf_counter()
        req = self.requests[request_id]
        tree.check_vocab(self.lm.vocab_size)
        tree = self._fit_context(tree, len(req.tokens))
        root_position = len(req.tokens) - 1  # == len(req.cache)
        compiled = compile_tree(tree, req.tokens[-1])
        visible = torch.cat([torch.ones(compiled.num_rows, root_position, dtype=torch.bool),
                             compiled.ancestors], dim=1)
        logits = self.lm.forward(req.cache, compiled.tokens, root_position + compiled.depths,
                                 visible)
        result = walk(compiled, logits, req.sampler, root_position)
        # KV rollback: keep the root's row and the accepted path's rows, drop the other nodes.
        req.cache.keep(root_position, [root_position + r for r in [0, *result.rows]])
        req.tokens.extend([*result.tokens, result.bonus])
        return StepOutcome(result, len(tree), time.perf_counter() - start)

    def _fit_context(self, tree: TokenTree, length: int) -> TokenTree:
        """Drops nodes whose position would fall outside the model's context."""
        max_depth = self.lm.context_length - length
        depths = tree.depths()
        if not tree or max(depths) <= max_depth:
            return tree
        keep = [i for i, d in enumerate(depths) if d <= max_depth]
        remap = {old: new for new, old in enumerate(keep)}
        return TokenTree(tuple(tree.tokens[i] for i in keep),
                         tuple(remap.get(tree.parents[i], -1) for i in keep))

    def verify_entry(self, entry: pool_pb2.DraftEntry) -> tuple[pool_pb2.VerifyResult, list[int]]:
        """Verifies a pool entry (its request loaded at entry.base_len); returns the result and
        the tokens to append to the request's state. Malformed trees give an error result."""
        result = pool_pb2.VerifyResult(request_id=entry.request_id, step=entry.step,
                                       base_len=entry.base_len, verifier=self.name)
        try:
            tree = TokenTree.from_pb(entry.tree)
            outcome = self.verify(entry.request_id, tree)
        except ValueError as err:
            result.error = str(err)
            return result, []
        w = outcome.walk
        result.accepted.extend(w.tokens)
        result.accepted_nodes.extend(w.nodes)
        result.bonus = w.bonus
        result.tree_size = outcome.tree_size
        result.verify_seconds = outcome.seconds
        return result, [*w.tokens, w.bonus]
