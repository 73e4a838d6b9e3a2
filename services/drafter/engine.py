"""Draft model engine: per-request caches, chain/top-k tree drafting, rollback to accepted tokens.

Cache convention as the verifier's: `rows` of the cache hold `tokens[:rows]`; committed tokens
past it (`pending`) are computed with the root in the next draft's first forward; speculative
rows are rolled back to the accepted path when the next call brings it (docs/drafters.md).
Trees: `depth` levels of at most `width` nodes (width 1: a greedy chain), each level the best
children by cumulative draft log-probability. Choices beyond the papers:
- `min_probability` stops deepening below an unsure level, HF's assistant confidence threshold
  applied to trees (docs/decisions/serving-defaults.md);
- sampled requests draft with the target's own random numbers (docs/decisions/coupled-drafting.md).
"""
from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specmesh_services.common.lm import CausalLM, KVCache, Part
from specmesh_services.common.sampling import (SamplingParams, coupled_scores, probabilities,
                                               race_weights, require_finite)
from specmesh_services.common.tree import TokenTree


@dataclass(frozen=True)
class Coupling:
    """A sampled request's draws, shared with the target: its processing, its seed, and the
    target's logits width (the race's random numbers are drawn over the target's ids)."""

    params: SamplingParams
    seed: int
    width: int

    @classmethod
    def of(cls, params: SamplingParams, width: int) -> "Coupling | None":
        """The coupling of a request sampled with `params` (None: greedy or unseeded, the
        draft's likeliest tokens are drafted)."""
        params.validate()
        if params.greedy or params.seed is None:
            return None
        if width < 1:
            raise ValueError("a sampled request needs the target's vocab size "
                             "(target_vocab_size) to draw the target's random numbers")
        return cls(params, params.seed, width)


@dataclass
class DraftState:
    cache: KVCache
    tokens: list[int]  # committed tokens (prompt + generated); tokens[-1] is the root
    rows: int  # committed tokens with cache rows: tokens[:rows]
    root_row: int | None = None  # row of the root after drafting
    node_rows: dict[int, int] = field(default_factory=dict)  # last tree's node -> cache row
    last_tree: TokenTree = field(default_factory=TokenTree)
    coupling: Coupling | None = None
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> race weights

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.rows:-1]


class DraftJob(NamedTuple):
    """One request's drafting work in `DraftModel.draft_many`."""

    request_id: str
    new_tokens: list[int]  # committed since the last call: accepted tokens + bonus
    depth: int
    width: int
    min_probability: float = 0.0  # stop below a level this unsure (module docstring)
    context_len: int = 0  # the request's tokens before new_tokens (0: what the state holds)


MAX_DEPTH = 64  # tree levels a draft may ask for (the speculation depth's limit)
MAX_WIDTH = 64  # nodes per level


def check_job(item: DraftJob) -> None:
    """Raises ValueError naming the field when a draft's shape is out of range (NaN and
    infinities included): checked for every item before any is committed."""
    require_finite("min_probability", item.min_probability)
    if not 0.0 <= item.min_probability < 1.0:
        raise ValueError(f"min_probability must be in [0, 1), got {item.min_probability}")
    if not 0 <= item.depth <= MAX_DEPTH:
        raise ValueError(f"depth must be in [0, {MAX_DEPTH}], got {item.depth}")
    if not 0 <= item.width <= MAX_WIDTH:
        raise ValueError(f"width must be in [0, {MAX_WIDTH}] (0 and 1 draft a chain), "
                         f"got {item.width}")


class DraftModel:
    """One draft model and its requests' caches."""

    def __init__(self, lm: CausalLM, name: str, kind: str) -> None:
        self.lm = lm
        self.name = name
        self.kind = kind  # "truncated" | "model"
        self.requests: dict[str, DraftState] = {}
        self.level_seconds = 0.0  # one drafting forward of one request (`measure`), 0 = unknown
        self.prefill_token_seconds = 0.0  # prefill per context token (`measure`), 0 = unknown
        # token id of each logit column where the forward returns the draft vocabulary only
        ids = getattr(lm, "token_ids", None)
        self.column_tokens: list[int] | None = None if ids is None else ids.tolist()
        self._column_ids = None if ids is None else torch.as_tensor(self.column_tokens)

    def measure(self, context: int = 32, depth: int = 4, reps: int = 3) -> float:
        """Times drafting forwards of one request over a short context (a warm-up draft, then
        the fastest of `reps` chains of `depth`): `level_seconds`, which routers take as this
        model's drafting cost until they have timed their own drafts; and the fastest of `reps`
        prefills of 4 x `context` tokens: `prefill_token_seconds`, what moving a request here
        costs per token of its context. Leaves no request behind."""
        request_id = f"__measure-{id(self)}"
        tokens = [t % self.lm.vocab_size for t in range(1, context + 1)]
        try:
            self.prefill(request_id, tokens)
            self.draft(request_id, [], depth, 1)  # warm-up: new shapes
            best = min(self.draft(request_id, [tokens[0]], depth, 1)[1] for _ in range(reps))
            long = tokens * 4
            prefill = []
            for _ in range(reps):
                start = time.perf_counter()
                self.prefill(request_id, long)
                prefill.append(time.perf_counter() - start)
        finally:
            self.release(request_id)
        self.level_seconds = best / depth
        self.prefill_token_seconds = min(prefill) / len(long)
        return self.level_seconds

    def prefill(self, request_id: str, tokens: list[int], coupling: Coupling | None = None
                ) -> int:
        """(Re)builds the request's cache from its whole context; returns len(tokens).
        `coupling`: a sampled request's draws (drafted with the target's random numbers)."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        self._check_vocab(tokens)
        self.release(request_id)  # a request prefilled again: its old rows go first
        cache = self.lm.new_cache()
        self.lm.prefill(cache, tokens[:-1])
        self.requests[request_id] = DraftState(cache, list(tokens), len(tokens) - 1,
                                               coupling=coupling)
        return len(tokens)

    def release(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is not None and hasattr(state.cache, "free"):  # rows in a shared store
            state.cache.free()
        return state is not None

    def draft(self, request_id: str, new_tokens: list[int], depth: int, width: int,
              min_probability: float = 0.0) -> tuple[TokenTree, float]:
        """Commits `new_tokens`, then drafts a tree below the new root; returns it and seconds."""
        return self.draft_many([DraftJob(request_id, new_tokens, depth, width,
                                         min_probability)])[0]

    def draft_many(self, items: Sequence[DraftJob | tuple]) -> list[tuple[TokenTree, float]]:
        """`draft` for several requests (DraftJobs, or tuples of their fields) at once: their
        forwards run level by level as ONE forward per level (`CausalLM.forward_many`), so the
        weights are read once for all of them. Every item is checked before any is committed.
        Seconds per item: the batch's time divided by its items (its share of the drafter)."""
        start = time.perf_counter()
        items = [DraftJob(*item) for item in items]
        if len({item.request_id for item in items}) < len(items):  # a request twice: in turn
            return [self.draft_many([item])[0] for item in items]
        for item in items:
            check_job(item)
        states = []
        for item in items:
            state = self.requests.get(item.request_id)
            if state is None:
                raise KeyError(f"request {item.request_id} is not prefilled on drafter "
                               f"{self.name}")
            self._check_vocab(item.new_tokens)
            if item.context_len > len(state.tokens):
                raise ValueError(f"request {item.request_id} holds {len(state.tokens)} tokens "
                                 f"on drafter {self.name}, the call follows "
                                 f"{item.context_len}: prefill it again")
            states.append(state)
        runs: list[Generator[Part, torch.Tensor, TokenTree]] = []
        for state, item in zip(states, items):
            self.commit(state, self.rewind(state, item.context_len, list(item.new_tokens)))
            runs.append(self._grow(state, item.depth, max(1, item.width), item.min_probability)
                        if item.depth > 0 else self._catch_up(state))
        trees: list[TokenTree | None] = [None] * len(runs)
        asks: dict[int, Part] = {}
        for i, run in enumerate(runs):
            self._advance(i, run, None, asks, trees)
        while asks:
            order = list(asks)
            for i, logits in zip(order, self.lm.forward_many([asks[i] for i in order])):
                self._advance(i, runs[i], logits, asks, trees)
        seconds = (time.perf_counter() - start) / max(1, len(items))
        return [(tree, seconds) for tree in trees]

    @staticmethod
    def _advance(i: int, run: Generator, logits: torch.Tensor | None, asks: dict[int, Part],
                 trees: list) -> None:
        """Feeds a drafting run its last forward's logits; records its next forward or tree."""
        try:
            asks[i] = next(run) if logits is None else run.send(logits)
        except StopIteration as done:
            asks.pop(i, None)
            trees[i] = done.value

    # rollback ---------------------------------------------------------------------------------
    @staticmethod
    def rewind(state: DraftState, context_len: int, new_tokens: list[int]) -> list[int]:
        """Pre-speculation's rollback: when the state holds tokens past `context_len` (an
        outcome drafted ahead that did not come true), keeps the longest prefix they share
        with `new_tokens` and drops the rest (the tree drafted on it, rows of tokens not
        shared). Returns the new tokens to commit from where the state then stops."""
        if not context_len or len(state.tokens) == context_len:
            return new_tokens
        held = state.tokens[context_len:]
        shared = 0
        while shared < min(len(held), len(new_tokens)) and held[shared] == new_tokens[shared]:
            shared += 1
        del state.tokens[context_len + shared:]
        rest = new_tokens[shared:] or [state.tokens.pop()]  # the root must be committed anew
        state.rows = min(state.rows, len(state.tokens) - 1)
        state.cache.truncate(state.rows)
        state.root_row, state.node_rows, state.last_tree = None, {}, TokenTree()
        return rest

    def commit(self, state: DraftState, new_tokens: list[int]) -> None:
        """Accepted draft tokens + bonus arrive: keep the rows of the accepted path, drop the rest."""
        if not new_tokens:
            return
        keep: list[int] = []
        if state.root_row is not None:
            keep.append(state.root_row)
            node = -1
            for token in new_tokens[:-1]:  # the last one is the new root: no row needed
                child = next((i for i, (t, p) in enumerate(zip(state.last_tree.tokens,
                                                                state.last_tree.parents))
                              if p == node and t == token and i in state.node_rows), None)
                if child is None:
                    break
                keep.append(state.node_rows[child])
                node = child
        state.cache.keep(state.rows, keep)
        state.rows += len(keep)
        state.tokens.extend(new_tokens)
        state.root_row, state.node_rows, state.last_tree = None, {}, TokenTree()

    # Drafting runs are generators: each yields the forward it needs next (a `Part`), receives
    # that part's logits, and returns the tree; `draft_many` runs several in step.
    def _catch_up(self, state: DraftState) -> Generator[Part, torch.Tensor, TokenTree]:
        """Computes the pending rows without drafting (depth 0)."""
        state.cache.truncate(state.rows)
        state.root_row, state.node_rows, state.last_tree = None, {}, TokenTree()
        pending = state.pending
        if pending:
            yield Part(state.cache, torch.tensor(pending, dtype=torch.long),
                       logits_from=len(pending))
            state.rows += len(pending)
        return TokenTree()

    # drafting ---------------------------------------------------------------------------------
    def _grow(self, state: DraftState, depth: int, width: int, min_probability: float = 0.0
              ) -> Generator[Part, torch.Tensor, TokenTree]:
        state.cache.truncate(state.rows)  # drops speculative rows of a tree never committed
        state.node_rows = {}
        pending = state.pending
        chain = torch.tensor([*pending, state.tokens[-1]], dtype=torch.long)
        logits = yield Part(state.cache, chain, logits_from=len(chain) - 1)  # [1, V]: the root
        state.rows += len(pending)
        state.root_row = state.rows
        root_pos = len(state.tokens) - 1
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier: list[int] = [-1]  # node indices whose logits are in `logits`, root = -1
        frontier_scores = torch.zeros(1, device=logits.device)
        for level in range(1, depth + 1):
            own, ranked = self._rank(state, logits, root_pos + level)
            logp = ranked + frontier_scores[:, None]
            k = min(width, logp.shape[-1])
            best, flat = torch.topk(logp.flatten(), k)
            new_nodes = []
            for score, index in zip(best.tolist(), flat.tolist()):
                if score == float("-inf"):  # outside the processed distribution's support
                    break
                parent_slot, column = divmod(index, logp.shape[-1])
                parents.append(frontier[parent_slot])
                tokens.append(column if self.column_tokens is None
                              else self.column_tokens[column])
                scores.append(score)
                new_nodes.append(len(tokens) - 1)
            if level == depth or not new_nodes:
                break
            best = best[:len(new_nodes)]
            if min_probability > 0:
                # the likeliest node of the level (cumulative score), given its parent
                slot, column = divmod(int(flat[0]), logp.shape[-1])
                if float(own[slot, column].exp()) < min_probability:
                    break
            logits = yield self._expand(state, tokens, parents, new_nodes, root_pos + level)
            frontier, frontier_scores = new_nodes, best
        tree = TokenTree(tuple(tokens), tuple(parents), tuple(scores), (0,) * len(tokens),
                         (self.name,))
        state.last_tree = tree
        return tree

    def _rank(self, state: DraftState, logits: torch.Tensor, position: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The level's log-probabilities given each frontier node [F, V], and what the level is
        ranked by: the same, or for a coupled request the target's race at `position`."""
        coupling = state.coupling
        if coupling is None:
            own = torch.log_softmax(logits, dim=-1)
            return own, own
        probs = probabilities(logits, coupling.params)
        weights = state.weights.get(position)
        if weights is None:
            for old in [p for p in state.weights if p < len(state.tokens)]:
                del state.weights[old]  # committed positions are drawn
            weights = state.weights[position] = self._columns(
                race_weights(coupling.seed, position, coupling.width)).to(logits.device)
        return torch.log(probs), coupled_scores(probs, weights)

    def _columns(self, weights: torch.Tensor) -> torch.Tensor:
        """The race weights of this draft's logit columns (by the token id of each; ids the
        target lacks never win)."""
        if self._column_ids is not None:
            return weights[self._column_ids]
        size = self.lm.vocab_size
        if size <= weights.numel():
            return weights[:size]
        return torch.cat([weights, torch.full((size - weights.numel(),), float("inf"))])

    def _expand(self, state: DraftState, tokens: list[int], parents: list[int],
                nodes: list[int], position: int) -> Part:
        """The forward of one level of nodes (each seeing the committed rows, the root and its
        ancestors); their cache rows are recorded (the forward appends them in this order)."""
        past = len(state.cache)
        visible = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool)
        visible[:, : state.root_row + 1] = True
        for slot, node in enumerate(nodes):
            visible[slot, past + slot] = True
            parent = parents[node]
            while parent >= 0:
                visible[slot, state.node_rows[parent]] = True
                parent = parents[parent]
        batch = torch.tensor([tokens[i] for i in nodes], dtype=torch.long)
        for slot, node in enumerate(nodes):
            state.node_rows[node] = past + slot
        return Part(state.cache, batch, torch.full((len(nodes),), position), visible)

    def _check_vocab(self, tokens: list[int]) -> None:
        if any(not 0 <= t < self.lm.vocab_size for t in tokens):
            raise ValueError(f"token ids outside the draft vocabulary [0, {self.lm.vocab_size})")
