"""Verifier engine: continuous batching of tree verification over one packed forward pass.

Plain Python over torch (no gRPC, no Redis): the worker feeds it batches of pool entries, tests
call it directly. Each `step` admits trees under a token budget and the KV budget (evicting
idle requests least-recently-used first, deferring what still does not fit, never dropping),
builds one segment per request (the tokens not yet in the KV store as a causal chain, chunked
over steps, then root + tree), runs ONE forward (packed.py), walks each tree (walk.py) and
commits the accepted rows (the rest rolled back). The KV store holds every token of a request
but the last, the next tree's root. The step in full: docs/verifier.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specmesh_kernels.backend import AttentionBackend, select_attention_backend
from specmesh_services.common.kv import KVStore
from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.lm import CausalLM
from specmesh_services.common.sampling import Sampler, SamplingParams
from specmesh_services.common.tree import CompiledTree, TokenTree, compile_tree
from specmesh_services.verifier.cost import VerifyCostModel
from specmesh_services.verifier.lookup import LookupGate, NgramLookup
from specmesh_services.verifier.packed import PackedTarget, Segment
from specmesh_services.verifier.run_heads import HeadsGate
from specmesh_services.verifier.walk import WalkResult, row_draws, walk, walk_draws
from specmesh.v1 import pool_pb2

log = logging.getLogger(__name__)


@dataclass
class RequestKV:
    """A request as the verifier holds it (its KV rows live in the KVStore)."""

    state: pool_pb2.RequestState
    sampler: Sampler
    tokens: list[int]  # prompt + generated
    last_used: float = field(default_factory=time.monotonic)
    # final hidden states of the last step's root and accepted nodes (lean target only): what
    # draft heads condition on
    hidden: torch.Tensor | None = None
    lookup: NgramLookup | None = None  # plain runs' prompt lookup (`lookup.py`), made on first use

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.state.prompt_ids)


@dataclass(frozen=True)
class StepOutcome:
    walk: WalkResult
    tree_size: int
    seconds: float  # the whole batched step this tree was verified in
    batch_size: int = 1  # trees in that step
    batch_nodes: int = 0  # draft nodes of all those trees
    batch_rows: int = 0  # rows of the forward pass (prefill chunks included)


@dataclass(frozen=True)
class StepResult:
    """What a step did with one item: an outcome, an error, or deferred to a later step."""

    request_id: str
    outcome: StepOutcome | None = None
    error: str | None = None

    @property
    def deferred(self) -> bool:
        return self.outcome is None and self.error is None


@dataclass(frozen=True)
class StepStats:
    """Shape and cost of one batched step (the verify-cost model's observation)."""

    rows: int  # new rows in the forward pass
    context: int  # KV positions attention read (sum over segments of prefix + new rows)
    segments: int  # requests in the pass
    trees: int  # of which verified a tree (the others prefilled a chunk)
    seconds: float  # planning + forward (what results report as verify_seconds)
    forward_seconds: float = 0.0  # of which the target's forward pass
    walk_seconds: float = 0.0  # after it: the walks and KV commits of all trees
    bucket: int = 0  # rows the forward was padded to, replayed from a CUDA graph (0: eager)
    chunks: int = 0  # of that graph, the KV chunks a segment was split into (0: not split)


@dataclass(frozen=True)
class EngineLimits:
    kv_budget_tokens: int = 16384  # KV rows held for all requests together
    block_size: int = 16  # KV allocation unit (rows)
    max_batch_tokens: int = 1024  # new rows per forward pass (trees + prefill chunks)
    max_batch_trees: int = 64  # requests per forward pass
    graph_rows: int = 512  # CUDA, lean target: steps of up to this many rows replay graphs (0: off)
    run_lookup: int = 3  # plain runs draft from the request's own n-grams of this length (0: off)
    run_lookup_tokens: int = 5  # at most this many tokens a lookup
    run_heads: int = 16  # plain runs verify the served heads' tree of this many nodes (0: off)
    run_ahead: int = 0  # graph-replayed plain rounds: steps a host sync (0, 1: one)


@dataclass
class _Planned:
    req: RequestKV
    request_id: str
    tree: TokenTree | None  # None: a prefill chunk only
    segment: Segment
    compiled: CompiledTree | None = None


class VerifierEngine:
    def __init__(self, lm: CausalLM | LeanDecoder, name: str = "verifier",
                 limits: EngineLimits | None = None,
                 backend: AttentionBackend | None = None) -> None:
        self.lm = lm
        self.name = name
        self.limits = limits or EngineLimits()
        self.backend = backend or select_attention_backend(lm.device)
        self.store, self.target = self._kv_and_forward()
        self.requests: dict[str, RequestKV] = {}
        # every tree row drawn at once where the logits live, one copy to the host a step (a
        # GPU); else the walk samples the rows it visits (fewer products on a CPU)
        self.row_parallel_walk = lm.device.type == "cuda"
        self.cost = VerifyCostModel()
        self.lookup_gate = LookupGate(self.limits.run_lookup_tokens)  # plain runs' prompt lookup
        self.lookup_drafted = self.lookup_accepted = 0  # its tokens verified, accepted
        self.heads_gate = HeadsGate(self.lookup_gate, self.limits.run_heads)  # heads in runs
        self.run_heads_drafted = self.run_heads_accepted = 0  # their nodes verified, accepted
        self.ahead_rounds = self.ahead_tokens = 0  # rounds decoded ahead, their tokens kept
        self._root = compile_tree(TokenTree(), 0)  # a plain row (its draws read depths only)
        self.steps = 0
        self.last_step: StepStats | None = None
        self.prefill_rows = 0
        self.evictions = 0
        # draft heads (services/heads/draft.py) drafting each asking request's next tree right
        # after its step, from the hidden state the step just computed
        self.heads = None
        self.heads_seconds = 0.0

    def _kv_and_forward(self):
        """The KV store and the batched forward over it (another backend's in a subclass)."""
        lm, cfg = self.lm, self.lm.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        store = KVStore(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim,
                        self.limits.kv_budget_tokens, self.limits.block_size, lm.dtype,
                        lm.device, compact=self.backend.compact)
        target = PackedTarget(lm if isinstance(lm, LeanDecoder) else lm.model, store,
                              self.backend)
        if isinstance(lm, LeanDecoder) and lm.device.type == "cuda" and self.limits.graph_rows \
                and self.backend.name in ("triton", "flash-attn"):
            from specmesh_services.common.graphs import StepGraphs

            target.graphs = StepGraphs(lm, store, self.limits.graph_rows)
        return store, target

    def capture_graphs(self) -> float:
        """Captures the CUDA graphs of every row bucket now (else each on its first step);
        seconds taken, 0 when the step does not run from graphs."""
        graphs = getattr(self.target, "graphs", None)
        return graphs.capture_all() if graphs is not None and graphs.capture else 0.0

    # request lifecycle ------------------------------------------------------------------------
    def ready_for(self, request_id: str, base_len: int) -> bool:
        """Whether the engine holds `request_id` at exactly `base_len` generated tokens."""
        req = self.requests.get(request_id)
        return req is not None and req.generated == base_len

    def load(self, state: pool_pb2.RequestState, generated: list[int]) -> None:
        """(Re)registers a request at prompt + generated; its KV is (re)built by the next step."""
        tokens = list(state.prompt_ids) + list(generated)
        if not tokens:
            raise ValueError(f"request {state.request_id} has an empty prompt")
        self._keep_common_rows(state.request_id, tokens)
        sampler = Sampler(SamplingParams.from_pb(state.sampling), state.seed,
                          prompt_len=len(state.prompt_ids))
        self.requests[state.request_id] = RequestKV(state, sampler, tokens)

    def _keep_common_rows(self, request_id: str, tokens: list[int]) -> None:
        """Keeps the KV rows a re-registered request shares with what the engine held (e.g. the
        pool moved it back to an earlier step); frees the rest."""
        old = self.requests.get(request_id)
        common = 0
        if old is not None:
            limit = min(len(old.tokens), len(tokens) - 1, self.store.length(request_id))
            while common < limit and old.tokens[common] == tokens[common]:
                common += 1
        if common == 0:
            self.store.free(request_id)
            return
        self.store.set_length(request_id, common)
        self.store.truncate_blocks(request_id)

    def release(self, request_id: str) -> bool:
        self.store.free(request_id)
        return self.requests.pop(request_id, None) is not None

    def cached(self, request_id: str) -> int:
        """KV rows the store holds for the request."""
        return self.store.length(request_id)

    # verification -----------------------------------------------------------------------------
    def verify(self, request_id: str, tree: TokenTree) -> StepOutcome:
        """Verifies one tree alone (steps until it is not deferred, i.e. through prefill chunks)."""
        while True:
            (result,) = self.step([(request_id, tree)])
            if result.error:
                raise ValueError(result.error)
            if result.outcome:
                return result.outcome

    def step(self, items: list[tuple[str, TokenTree]]) -> list[StepResult]:
        """Verifies trees of distinct requests in one forward pass; one result per item.

        Requests holding KV rows go first (they may evict idle ones to grow); requests without
        (new, or evicted earlier) are admitted in order while free memory lasts, never by
        evicting: the first that does not fit stops admission for this step (no starvation)."""
        start = time.perf_counter()
        results: dict[int, StepResult] = {}
        planned: dict[int, _Planned] = {}
        budget, admitting = self.limits.max_batch_tokens, True
        order = sorted(range(len(items)), key=lambda i: (self.store.length(items[i][0]) == 0, i))
        for i in order:
            request_id, tree = items[i]
            running = self.store.length(request_id) > 0
            if len(planned) >= self.limits.max_batch_trees or not (running or admitting):
                results[i] = StepResult(request_id)  # deferred
                continue
            try:
                plan = self._plan(request_id, tree, budget, list(planned.values()), running)
            except (KeyError, ValueError) as err:
                msg = err.args[0] if isinstance(err, ValueError) else f"unknown request {err}"
                results[i] = StepResult(request_id, error=str(msg))
                continue
            if plan is None:
                results[i] = StepResult(request_id)  # deferred
                admitting = admitting and running
                continue
            planned[i] = plan
            budget -= plan.segment.num_rows
        if planned:
            forward_start = time.perf_counter()
            logits = self.target.forward([p.segment for p in planned.values()])
            # on a GPU the draws' copy to the host is the step's one sync: the forward's time
            # ends with it
            draws = _device_draws(list(planned.values()), logits) if self.row_parallel_walk \
                else [None] * len(planned)
            if self.lm.device.type == "cuda" and all(d is None for d in draws):
                torch.cuda.synchronize(self.lm.device)  # prefill chunks only: nothing copied
            forward_end = time.perf_counter()
            seconds = forward_end - start
            trees = sum(1 for p in planned.values() if p.tree is not None)
            nodes = sum(len(p.tree) for p in planned.values() if p.tree is not None)
            shape = (trees, nodes, sum(p.segment.num_rows for p in planned.values()))
            hidden = self.target.hidden or [None] * len(planned)
            kept = self.target.survivors
            for (i, plan), rows, states, alive, drawn in zip(planned.items(), logits, hidden,
                                                              kept, draws):
                results[i] = self._commit(plan, rows, seconds, shape, states, alive, drawn)
            self._observe(list(planned.values()), trees, seconds, forward_end - forward_start,
                          time.perf_counter() - forward_end)
        return [results[i] for i in range(len(items))]

    # planning ---------------------------------------------------------------------------------
    def _plan(self, request_id: str, tree: TokenTree, budget: int, in_batch: list[_Planned],
              may_evict: bool) -> _Planned | None:
        req = self.requests[request_id]
        if any(p.request_id == request_id for p in in_batch):
            return None  # one tree per request per step: the other waits
        tree.check_vocab(self.lm.vocab_size)
        tree = self._fit_context(tree, len(req.tokens))
        total = len(req.tokens) + len(tree)  # positions after this step's rows
        if total > self.store.capacity:
            raise ValueError(f"request needs {total} KV rows but the verifier's KV budget is "
                             f"{self.store.capacity} (raise verifier.kv_budget_tokens)")
        cached = self.store.length(request_id)
        chain = req.tokens[cached:-1]
        rows = len(chain) + 1 + len(tree)
        if rows <= budget or not in_batch:
            if not self._make_room(request_id, total, in_batch, may_evict):
                return None
            compiled = compile_tree(tree, req.tokens[-1])
            segment = self._segment(request_id, req, cached, compiled)
            return _Planned(req, request_id, tree, segment, compiled)
        if chain and budget > 0:  # the prefill does not fit: a chunk of it now, the rest later
            end = cached + min(len(chain), budget)
            if not self._make_room(request_id, end, in_batch, may_evict):
                return None
            seg = _chain_segment(request_id, req.tokens[cached:end], cached)
            return _Planned(req, request_id, None, seg)
        return None

    def _segment(self, request_id: str, req: RequestKV, cached: int, compiled: CompiledTree
                 ) -> Segment:
        chain = req.tokens[cached:-1]
        c, m = len(chain), compiled.num_rows
        root = len(req.tokens) - 1
        if not c:  # the tree alone (every step after the prefill): its own buffers
            return Segment(request_id, cached, compiled.tokens, root + compiled.depths,
                           compiled.ancestors, logits_from=0, parents=compiled.parents)
        mask = torch.zeros(c + m, c + m, dtype=torch.bool)
        mask[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        mask[c:, :c] = True
        mask[c:, c:] = compiled.ancestors
        positions = torch.cat([torch.arange(cached, root), root + compiled.depths])
        tokens = torch.cat([torch.tensor(chain, dtype=torch.long), compiled.tokens])
        return Segment(request_id, cached, tokens, positions, mask, logits_from=c,
                       parents=compiled.parents)

    def _make_room(self, request_id: str, positions: int, in_batch: list[_Planned],
                   may_evict: bool) -> bool:
        """Reserves KV for `positions`; a running request may evict idle ones (least recently
        used first: they re-prefill when their next tree comes). False: deferred."""
        if self.store.reserve(request_id, positions):
            return True
        if not may_evict:
            return False
        busy = {p.request_id for p in in_batch} | {request_id}
        victims = sorted((r for r in self.requests.items() if r[0] not in busy
                          and self.store.length(r[0]) > 0), key=lambda r: r[1].last_used)
        for victim_id, _ in victims:
            self.store.free(victim_id)
            self.evictions += 1
            log.info("KV budget full: evicted %s (re-prefilled when it comes back)", victim_id)
            if self.store.reserve(request_id, positions):
                return True
        return False  # deferred until requests in flight finish

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

    # commit -----------------------------------------------------------------------------------
    def _commit(self, plan: _Planned, logits: torch.Tensor, seconds: float,
                shape: tuple[int, int, int], hidden: torch.Tensor | None = None,
                kept: torch.Tensor | None = None, drawn: list[int] | None = None) -> StepResult:
        """`shape`: (trees, their nodes, rows) of the whole step; `hidden`: the tree rows' final
        hidden states, when the target gives them; `kept`: the compiled rows early pruning kept
        (`logits` and `hidden` hold those rows only), None: all; `drawn`: every row's draw,
        made on the device (`_device_draws`)."""
        req, seg = plan.req, plan.segment
        req.last_used = time.monotonic()
        self.prefill_rows += seg.logits_from
        if plan.tree is None:  # prefill chunk
            self.store.set_length(plan.request_id, seg.start + seg.num_rows)
            return StepResult(plan.request_id)
        root = len(req.tokens) - 1
        compiled = plan.compiled if kept is None else _subtree(plan.compiled, kept.tolist())
        result = walk(compiled, logits, req.sampler, req.tokens) if drawn is None \
            else walk_draws(compiled, drawn)
        local = result.rows  # rows of the walked tree: of the survivors' logits and states
        if kept is not None:  # back to the rows of the tree as drafted
            result = WalkResult([int(kept[r]) for r in local], result.tokens, result.bonus)
        self.store.commit(plan.request_id, root, [0, *result.rows])
        if hidden is not None:
            req.hidden = hidden[[0, *local]]
        req.tokens.extend([*result.tokens, result.bonus])
        return StepResult(plan.request_id, StepOutcome(result, len(plan.tree), seconds, *shape))

    def _observe(self, planned: list[_Planned], trees: int, seconds: float,
                 forward_seconds: float = 0.0, walk_seconds: float = 0.0) -> None:
        rows = sum(p.segment.num_rows for p in planned)
        context = sum(p.segment.start + p.segment.num_rows for p in planned)
        self._record(StepStats(rows, context, len(planned), trees, seconds, forward_seconds,
                               walk_seconds, getattr(self.target, "last_bucket", 0),
                               getattr(self.target, "last_chunks", 0)))

    def _record(self, stats: StepStats) -> None:
        """A step done: its stats for metrics and traces, an observation of the cost model."""
        self.last_step = stats
        self.cost.observe(stats.rows, stats.context, stats.segments, stats.seconds)
        self.steps += 1

    # pool entries -----------------------------------------------------------------------------
    def step_entries(self, entries: list[pool_pb2.DraftEntry]
                     ) -> list[tuple[pool_pb2.VerifyResult, list[int]] | None]:
        """Verifies pool entries (requests loaded at entry.base_len) in one step: per entry the
        result and the tokens to append to the request's state, or None if deferred."""
        items, out = [], []
        for entry in entries:
            try:
                items.append((entry.request_id, TokenTree.from_pb(entry.tree)))
            except ValueError as err:
                items.append((entry.request_id, err))
        valid = [(i, it) for i, it in enumerate(items) if isinstance(it[1], TokenTree)]
        stepped = dict(zip((i for i, _ in valid), self.step([it for _, it in valid])))
        for i, entry in enumerate(entries):
            result = pool_pb2.VerifyResult(request_id=entry.request_id, step=entry.step,
                                           base_len=entry.base_len, verifier=self.name)
            step = stepped.get(i)
            if step is None or step.error:
                result.error = str(items[i][1]) if step is None else step.error
                out.append((result, []))
            elif step.deferred:
                out.append(None)
            else:
                w = step.outcome.walk
                result.accepted.extend(w.tokens)
                result.accepted_nodes.extend(w.nodes)
                result.bonus = w.bonus
                result.tree_size = step.outcome.tree_size
                result.verify_seconds = step.outcome.seconds
                result.batch_trees = step.outcome.batch_size
                result.batch_nodes = step.outcome.batch_nodes
                result.batch_rows = step.outcome.batch_rows
                result.batch_capacity = self.limits.max_batch_trees
                out.append((result, [*w.tokens, w.bonus]))
        self._draft_heads(entries, out)
        self._plain_runs(entries, out)
        return out

    def _plain_runs(self, entries: list[pool_pb2.DraftEntry], out: list) -> None:
        """Entries of empty trees with `plain_tokens` > 1 decode on, one forward for all of
        them a round (their tokens in `continued`), until each has its tokens or ends (a stop
        token; a deferred or failed round keeps what it has): several plain tokens for one pool
        round trip. Only in a step without trees, whose requests would wait for the runs. A
        request whose last n-gram occurred before gets its continuation verified as a chain in
        the round (`lookup.py`): up to that many more tokens for the round's forward."""
        if any(len(entry.tree.tokens) for entry in entries):
            return
        runs = {entry.request_id: (i, entry.plain_tokens - 1)
                for i, (entry, done) in enumerate(zip(entries, out))
                if done is not None and not done[0].error and entry.plain_tokens > 1
                and not entry.heads_nodes and done[0].bonus not in entry.stop_token_ids}
        while runs:
            ids = list(runs)
            stops = [entries[runs[r][0]].stop_token_ids for r in ids]
            for request_id, tokens in zip(ids, self._run_round(ids, [runs[r][1] for r in ids],
                                                               stops)):
                i, left = runs.pop(request_id)
                if not tokens:
                    continue
                stop = entries[i].stop_token_ids
                ends = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
                tokens = tokens[:ends]
                out[i][0].continued.extend(tokens)
                out[i][1].extend(tokens)
                if left > len(tokens) and ends is None:
                    runs[request_id] = (i, left - len(tokens))

    def _run_round(self, request_ids: list[str], left: list[int],
                   stops: list | None = None) -> list[list[int]]:
        """One round of plain runs: each request's next tokens, at most its `left` ([]: deferred
        or failed: its run ends); a chain from prompt lookup where a request has one and the
        gate finds it pays (`lookup.LookupGate`), else the served heads' tree where theirs
        does (`run_heads.HeadsGate`); with neither, `run_ahead` steps where they can run
        ahead (`_ahead_round`), each request's tokens cut after its first of `stops`."""
        start, gate = time.perf_counter(), self.lookup_gate
        chains, rows, expected = [], len(request_ids), float(len(request_ids))
        heads: list[int] = []  # the requests whose round verifies the heads' tree
        for i, (request_id, k) in enumerate(zip(request_ids, left)):
            found = self._lookup(request_id, k - 1)
            length, gain = gate.length(rows, expected, len(found)) if found else (0, 0.0)
            if (not length and k > 1 and self._heads_ready(request_id)  # within one forward:
                    and rows + self.heads_gate.nodes <= self.limits.max_batch_tokens):
                gain = self.heads_gate.take(rows, expected)
                if gain:  # its rows counted at the tree's budget, its chain empty
                    heads.append(i)
                    length, found = self.heads_gate.nodes, []
            chains.append(found[:length])
            rows, expected = rows + length, expected + gain
        trees = self._heads_trees(request_ids, left, heads)
        if trees:
            out = self._tree_round(request_ids, [
                trees.get(i) or TokenTree(tuple(c), tuple(range(-1, len(c) - 1)))
                for i, c in enumerate(chains)])
            rows = len(request_ids) + sum(map(len, chains)) + sum(map(len, trees.values()))
        elif not any(chains) and (steps := self._ahead_steps(request_ids, left)):
            out = self._ahead_round(request_ids, steps, stops or [()] * len(request_ids))
            gate.observe_round(rows, (time.perf_counter() - start) / steps)
            return out
        else:
            out = self._chain_round(request_ids, chains)
        for i, (chain, tokens) in enumerate(zip(chains, out)):
            if chain and tokens:
                gate.observe_chain(len(chain), len(tokens) - 1)
                self.lookup_drafted += len(chain)
                self.lookup_accepted += len(tokens) - 1
            elif i in trees and tokens:
                self.heads_gate.observe(len(tokens) - 1)
                self.run_heads_drafted += len(trees[i])
                self.run_heads_accepted += len(tokens) - 1
        gate.observe_round(rows, time.perf_counter() - start)
        return out

    def _chain_round(self, request_ids: list[str], chains: list[list[int]]) -> list[list[int]]:
        """A round of plain runs, each request's lookup chain (or none: an empty tree) in one
        step: each request's accepted tokens and bonus ([]: deferred or failed)."""
        return self._tree_round(request_ids, [TokenTree(tuple(c), tuple(range(-1, len(c) - 1)))
                                              for c in chains])

    def _tree_round(self, request_ids: list[str], trees: list[TokenTree]) -> list[list[int]]:
        """A round of plain runs with a tree per request (empty: a plain row) in one step."""
        stepped = self.step(list(zip(request_ids, trees)))
        return [[] if s.outcome is None else [*s.outcome.walk.tokens, s.outcome.walk.bonus]
                for s in stepped]

    def _ahead_steps(self, request_ids: list[str], left: list[int]) -> int:
        """Steps a round of one plain row a request runs ahead (0: one step, as any round):
        the step runs from graphs, each request is caught up (its KV holds all its tokens but
        the last), samples without penalties (a draw reads no history) and has room for them
        in its context and the KV budget."""
        steps = min(self.limits.run_ahead, *left)
        graphs = getattr(self.target, "graphs", None)
        if steps < 2 or graphs is None or self.target.pruner is not None:
            return 0
        reqs = [self.requests.get(r) for r in request_ids]
        if any(r is None or r.sampler.params.penalized or self.store.length(i) != len(r.tokens)
               - 1 or len(r.tokens) + steps > self.lm.context_length
               for i, r in zip(request_ids, reqs)):
            return 0
        if not graphs.covers([_row_segment(i, 0, len(r.tokens) + steps - 2)
                              for i, r in zip(request_ids, reqs)]):  # the round's last step
            return 0
        if not all(self.store.reserve(i, len(r.tokens) - 1 + steps)
                   for i, r in zip(request_ids, reqs)):
            for request_id in request_ids:  # the KV budget is short: what was taken goes back
                if request_id in self.store.seqs:
                    self.store.truncate_blocks(request_id)
            return 0
        return steps

    def _ahead_round(self, request_ids: list[str], steps: int, stops: list
                     ) -> list[list[int]]:
        """`steps` plain steps of the requests replayed back to back, each step's draws fed to
        the next on the device and copied to the host once for all (`StepGraphs.ahead`): each
        request's tokens up to its first stop token; its KV kept up to them."""
        start = time.perf_counter()
        reqs = [self.requests[r] for r in request_ids]
        greedy = all(r.sampler.params.greedy for r in reqs)

        def draw(j: int, logits: torch.Tensor) -> torch.Tensor:
            if greedy:
                return torch.argmax(logits, dim=-1)
            return torch.cat([row_draws(self._root, logits[i:i + 1], r.sampler, (),
                                        base=len(r.tokens) + j) for i, r in enumerate(reqs)])

        draws, hidden = self.target.graphs.ahead(
            [_row_segment(i, r.tokens[-1], len(r.tokens) - 1) for i, r in zip(request_ids, reqs)],
            steps, draw)
        drawn = torch.stack(draws, dim=1).tolist()  # the round's one device-to-host copy
        forward_end = time.perf_counter()
        out = []
        for i, (request_id, req, tokens) in enumerate(zip(request_ids, reqs, drawn)):
            ends = next((k + 1 for k, t in enumerate(tokens) if t in stops[i]), steps)
            tokens = tokens[:ends]
            self.store.set_length(request_id, len(req.tokens) - 1 + len(tokens))
            self.store.truncate_blocks(request_id)
            req.tokens.extend(tokens)
            req.hidden = hidden[[i]] if ends == steps else None  # the heads' next tree
            req.last_used = time.monotonic()
            self.ahead_tokens += len(tokens)
            out.append(tokens)
        self.ahead_rounds += 1
        seconds = (time.perf_counter() - start) / steps
        context = sum(len(r.tokens) for r in reqs)
        bucket = self.target.graphs.last_bucket
        for _ in range(steps):  # per step: what a step of one row a request costs
            self._record(StepStats(len(reqs), context, len(reqs), len(reqs), seconds,
                                   (forward_end - start) / steps, 0.0, bucket,
                                   self.target.graphs.last_chunks))
        return out

    def _heads_ready(self, request_id: str) -> bool:
        """The heads can draft the request's next round: served, and its last step's hidden
        states kept."""
        req = self.requests.get(request_id)
        return (self.heads is not None and req is not None and req.hidden is not None
                and len(req.hidden) > 0)

    def _heads_trees(self, request_ids: list[str], left: list[int], chosen: list[int]
                     ) -> dict[int, TokenTree]:
        """The heads' trees of the `chosen` requests (by index) in one batch, each below the
        request's next token and no deeper than its run's tokens left allow."""
        if not chosen:
            return {}
        start = time.perf_counter()
        reqs = [self.requests[request_ids[i]] for i in chosen]
        trees = self.heads.draft(torch.stack([r.hidden[-1] for r in reqs]),
                                 [r.tokens[-1] for r in reqs],
                                 [self.heads_gate.nodes] * len(chosen),
                                 depth=max(1, min(left[i] - 1 for i in chosen)))
        self.heads_seconds += time.perf_counter() - start
        return {i: tree for i, tree in zip(chosen, trees) if len(tree)}

    def _lookup(self, request_id: str, limit: int) -> list[int]:
        """The chain prompt lookup drafts for a request's next round (up to `limit` tokens)."""
        n = self.limits.run_lookup
        req = self.requests.get(request_id)
        if not n or limit <= 0 or req is None:
            return []
        if req.lookup is None:
            req.lookup = NgramLookup(n)
        return req.lookup.draft(req.tokens, min(limit, self.limits.run_lookup_tokens))

    def _draft_heads(self, entries: list[pool_pb2.DraftEntry], out: list) -> None:
        """Fills the heads' trees of the entries that asked for one, in one batch: each below
        its step's bonus token, grounded on its last accepted token's final hidden state."""
        if self.heads is None:
            return
        asked = [(entry, done[0]) for entry, done in zip(entries, out)
                 if entry.heads_nodes and done is not None and not done[0].error]
        asked = [(e, r) for e, r in asked
                 if (req := self.requests.get(e.request_id)) is not None
                 and req.hidden is not None and len(req.hidden)]
        if not asked:
            return
        start = time.perf_counter()
        hidden = torch.stack([self.requests[e.request_id].hidden[-1] for e, _ in asked])
        trees = self.heads.draft(hidden, [r.bonus for _, r in asked],
                                 [e.heads_nodes for e, _ in asked])
        seconds = time.perf_counter() - start
        self.heads_seconds += seconds
        for (_, result), tree in zip(asked, trees):
            result.heads_tree.CopyFrom(tree.to_pb())
            result.heads_seconds = seconds / len(asked)


def _subtree(compiled: CompiledTree, kept: list[int]) -> CompiledTree:
    """The compiled tree of the rows `kept` (sorted, root 0 first, each row's parent kept)."""
    index = {row: i for i, row in enumerate(kept)}
    parents = compiled.parents.tolist()
    tree = TokenTree(tuple(int(compiled.tokens[r]) for r in kept[1:]),
                     tuple(index[parents[r]] - 1 for r in kept[1:]))
    return compile_tree(tree, int(compiled.tokens[0]))


def _chain_segment(request_id: str, tokens: list[int], start: int) -> Segment:
    n = len(tokens)
    return Segment(request_id, start, torch.tensor(tokens, dtype=torch.long),
                   torch.arange(start, start + n), torch.ones(n, n, dtype=torch.bool).tril(),
                   logits_from=n)


def _row_segment(request_id: str, token: int, position: int) -> Segment:
    """One plain row with logits: a tree's root alone."""
    return Segment(request_id, position, torch.tensor([token]), torch.tensor([position]),
                   torch.ones(1, 1, dtype=torch.bool), logits_from=0)


def _device_draws(planned: list[_Planned], logits: list[torch.Tensor]) -> list[list[int] | None]:
    """Every tree row's draw made where the logits are (`row_draws`) and copied to the host in
    one transfer for the whole step (None for a prefill chunk)."""
    trees = [i for i, p in enumerate(planned) if p.tree is not None]
    out: list[list[int] | None] = [None] * len(planned)
    if not trees:
        return out
    drawn = [row_draws(planned[i].compiled, logits[i], planned[i].req.sampler,
                       planned[i].req.tokens) for i in trees]
    flat = torch.cat(drawn).tolist()  # the step's one device-to-host copy of the walk
    at = 0
    for i, rows in zip(trees, drawn):
        out[i], at = flat[at:at + rows.numel()], at + rows.numel()
    return out
