"""The verifier engine over llama.cpp (common/ggml_model.py): the same planning, continuous
batching, walk and results as `VerifierEngine`, with the KV cache kept by llama.cpp and edited
by sequence operations. Each request holds one sequence; a step's trees get leaf sequences
(ggml_batch.py) and are decoded with every request's rows and prefill chunks in one
`llama_decode`. Served as `target_runner=ggml`; its decode cost grows with the rows faster than
the torch target's (docs/decisions/ggml-target.md).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh_services.common.tree import TokenTree
from specmesh_services.verifier.engine import (EngineLimits, StepOutcome, StepResult, StepStats,
                                               VerifierEngine)
from specmesh_services.verifier.walk import WalkResult
from specmesh_services.verifier.ggml_batch import TreeRows, tree_rows
from specmesh_services.common.ggml_model import GgmlModel
from specmesh_services.verifier.packed import Segment

__all__ = ["GgmlEngine", "GgmlLM", "load_target"]

# llama.cpp's limit on sequence ids (LLAMA_MAX_SEQ): one per request, one per leaf of its tree
MAX_SEQUENCES = 256


@dataclass
class GgmlLM:
    """What the engine and its servicer read of a target served by llama.cpp."""

    model: GgmlModel
    name: str
    context_length: int
    dtype: torch.dtype = torch.float32  # the logits'; the weights are the GGUF's own
    device: torch.device = torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


@dataclass(frozen=True)
class _Backend:
    name: str = "llama.cpp"


class GgmlStore:
    """`KVStore`'s interface over llama.cpp's cache: a sequence per request, lengths counted
    here, a budget of `capacity` cells for all of them (llama.cpp's context)."""

    block_size = 1

    def __init__(self, model: GgmlModel, capacity: int) -> None:
        self.model = model
        self.capacity = capacity
        self.seq: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.free_seqs = list(range(model.n_seq_max - 1, -1, -1))  # pop() = lowest
        self.max_requests = max(1, model.n_seq_max // 2)
        self.trees: dict[str, tuple[TreeRows, int]] = {}  # the last step's tree rows, their base

    @property
    def used_blocks(self) -> int:
        return sum(self.reserved.values())

    def length(self, request_id: str) -> int:
        return self.lengths.get(request_id, 0)

    def sequence(self, request_id: str) -> int:
        if request_id not in self.seq:
            if not self.free_seqs:
                raise ValueError(f"no free llama.cpp sequence for {request_id} "
                                 f"(n_seq_max {self.model.n_seq_max})")
            self.seq[request_id] = self.free_seqs.pop()
        return self.seq[request_id]

    def reserve(self, request_id: str, positions: int) -> bool:
        """False (the engine defers or evicts) when the cells or the requests' sequences are
        taken: requests hold at most half of llama.cpp's sequence ids, the trees' leaves the
        other half."""
        others = self.used_blocks - self.reserved.get(request_id, 0)
        if others + positions > self.capacity:
            return False
        if request_id not in self.seq and len(self.seq) >= self.max_requests:
            return False
        self.sequence(request_id)
        self.reserved[request_id] = max(positions, self.reserved.get(request_id, 0))
        return True

    def free(self, request_id: str) -> int:
        seq = self.seq.pop(request_id, None)
        self.lengths.pop(request_id, None)
        self.trees.pop(request_id, None)
        if seq is None:
            return 0
        self.model.seq_remove(seq)
        self.free_seqs.append(seq)
        return self.reserved.pop(request_id, 0)

    def set_length(self, request_id: str, length: int) -> None:
        """Positions 0 .. length - 1 committed; cells past them dropped."""
        self.model.seq_remove(self.sequence(request_id), length)
        self.lengths[request_id] = length

    def truncate_blocks(self, request_id: str) -> None:
        self.reserved[request_id] = self.length(request_id)

    def commit(self, request_id: str, base: int, keep: Sequence[int]) -> None:
        """After a step whose rows from `base` (the root) on were a tree: the accepted rows
        `keep` (row offsets from the root, ascending, the root first) join the request's
        sequence; the tree's other rows are dropped with its leaf sequences."""
        seq, end = self.sequence(request_id), base + len(keep)
        rows, first = self.trees.pop(request_id, (None, 0))
        if rows is not None:
            leaf = rows.leaf_of[first + keep[-1]]  # `first`: the root's row in the segment
            self.model.seq_copy(leaf, seq, rows.positions[0] + 1, end)
            for s in rows.leaf_seqs:
                self.model.seq_remove(s)
                self.free_seqs.append(s)
        self.model.seq_remove(seq, end)  # a chain's rejected rows
        self.lengths[request_id] = end
        self.truncate_blocks(request_id)


class GgmlTarget:
    """`PackedTarget`'s forward: the segments' rows in one decode (trees over leaf sequences,
    chains and prefill chunks in the request's own sequence), logits of the rows asked for."""

    def __init__(self, model: GgmlModel, store: GgmlStore) -> None:
        self.model, self.store = model, store
        self.hidden: list | None = None  # final hidden states of the logits' rows (heads)
        self.survivors: list = []

    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        store, rows = self.store, []
        for s in segments:
            seq, n = store.sequence(s.request_id), s.num_rows
            tokens, positions = s.tokens.tolist(), s.positions.tolist()
            parents = _segment_parents(s)
            if all(p == i - 1 for i, p in enumerate(parents)):  # a chain: the request's own
                seq_ids = [[seq]] * n
            else:
                tree = tree_rows(tokens, parents, positions[0], seq, store.free_seqs[::-1])
                del store.free_seqs[len(store.free_seqs) - len(tree.leaf_seqs):]
                for leaf in tree.leaf_seqs:
                    self.model.seq_copy(seq, leaf, 0, s.start)
                store.trees[s.request_id] = (tree, s.logits_from)
                seq_ids, positions = tree.seq_ids, tree.positions
            rows += [(t, p, q, i >= s.logits_from)
                     for i, (t, p, q) in enumerate(zip(tokens, positions, seq_ids))]
        logits = torch.from_numpy(self.model.decode(*map(list, zip(*rows))))
        self.survivors = [None] * len(segments)
        sizes = [s.num_rows - s.logits_from for s in segments]
        if self.model.embeddings:
            self.hidden = list(torch.from_numpy(self.model.hidden).split(sizes))
        return list(logits.split(sizes))


def _segment_parents(s: Segment) -> list[int]:
    """Each row's parent row in the segment: the pending chain first, then the tree (the
    compiled tree's parents, its root under the chain's last row)."""
    if s.parents is None:  # a prefill chunk
        return list(range(-1, s.num_rows - 1))
    chain = s.logits_from  # the chain's rows come before the tree's root
    return [*range(-1, chain), *(chain + p for p in s.parents.tolist()[1:])]


class GgmlEngine(VerifierEngine):
    """`VerifierEngine` with llama.cpp's kernels and cache for the target."""

    def __init__(self, lm: GgmlLM, name: str = "verifier",
                 limits: EngineLimits | None = None) -> None:
        super().__init__(lm, name, limits, _Backend())

    def _kv_and_forward(self):
        store = GgmlStore(self.lm.model, self.limits.kv_budget_tokens)
        return store, GgmlTarget(self.lm.model, store)

    def step(self, items: list[tuple[str, TokenTree]]) -> list[StepResult]:
        """A step of empty trees only, every request ready for it, is a plain run's round
        (`_direct_round`): the first token of a plain run costs what the run's others do. Not
        where the target serves draft heads (their grounding is the generic step's)."""
        limits = self.limits
        if (items and len(items) <= min(limits.max_batch_trees, limits.max_batch_tokens)
                and not self.lm.model.embeddings and not any(len(t) for _, t in items)):
            tokens = self._direct_round([r for r, _ in items])
            if tokens is not None:  # its time as the generic step counts it: to the forward's end
                seconds, rows = self.last_step.seconds, len(items)
                return [StepResult(r, StepOutcome(WalkResult([], [], t), 0, seconds, rows, 0,
                                                  rows)) for (r, _), t in zip(items, tokens)]
        return super().step(items)

    def _direct_round(self, request_ids: list[str]) -> list[int] | None:
        """A plain run's round as one `llama_decode` of each request's last token in its own
        sequence, sampled by the request's sampler: the generic step's planning, tree, walk and
        commit cost ~0.4 ms a token beside SmolLM2's 6-9 ms decode. None, doing nothing, where
        a request is not ready for it (unknown, KV behind, no room: the generic step's)."""
        out = self._decode_chains(request_ids, [[]] * len(request_ids))
        return None if out is None else [tokens[0] for tokens in out]

    def _chain_round(self, request_ids: list[str], chains: list[list[int]]) -> list[list[int]]:
        """A plain-run round, lookup chains or none, as one `llama_decode` (`_decode_chains`):
        the generic step's planning, tree and walk cost ~0.4-1.5 ms a round beside SmolLM2's
        decode. The generic step where a request is not ready for it or the target serves
        heads."""
        out = None if self.lm.model.embeddings else self._decode_chains(request_ids, chains)
        return out if out is not None else super()._chain_round(request_ids, chains)

    def _decode_chains(self, request_ids: list[str], chains: list[list[int]]
                       ) -> list[list[int]] | None:
        """One `llama_decode` of each request's last token and its chain in its own sequence
        (a chain needs no sequence sets), every row sampled in turn by the request's sampler
        while it draws the chain's next token, the rejected rows' cells removed: each request's
        accepted tokens and next token. None, doing nothing, where a request is not ready."""
        start = time.perf_counter()
        store, reqs = self.store, [self.requests.get(r) for r in request_ids]
        if not all(req is not None and store.length(r) == len(req.tokens) - 1
                   and store.reserve(r, len(req.tokens) + len(c))
                   for r, req, c in zip(request_ids, reqs, chains)):
            return None
        tokens, positions, sequences, context = [], [], [], 0
        for request_id, req, chain in zip(request_ids, reqs, chains):
            n = len(req.tokens)
            tokens += [req.tokens[-1], *chain]
            positions += range(n - 1, n + len(chain))
            sequences += [[store.sequence(request_id)]] * (len(chain) + 1)
            context += n + len(chain)
        forward_start = time.perf_counter()
        logits = self.lm.model.decode(tokens, positions, sequences, [True] * len(tokens))
        forward_end = time.perf_counter()
        out, row = [], 0
        for request_id, req, chain in zip(request_ids, reqs, chains):
            sampler, emitted = req.sampler, []
            for j in range(len(chain) + 1):  # row j: after the root and j accepted tokens
                emitted.append(sampler.sample(logits[row + j], len(req.tokens),
                                              req.tokens if sampler.needs_history else None))
                req.tokens.append(emitted[-1])
                if j == len(chain) or emitted[-1] != chain[j]:
                    break
            row += len(chain) + 1
            if len(emitted) <= len(chain):  # rows rejected: their cells go
                store.set_length(request_id, len(req.tokens) - 1)
            else:
                store.lengths[request_id] = len(req.tokens) - 1
            store.truncate_blocks(request_id)
            req.last_used = time.monotonic()
            out.append(emitted)
        self._record(StepStats(len(tokens), context, len(reqs), len(reqs), forward_end - start,
                               forward_end - forward_start, time.perf_counter() - forward_end))
        return out


def load_target(settings) -> GgmlLM:
    """The target of `settings` on llama.cpp: its GGUF file (models.gguf_file) in one context of
    `verifier.kv_budget_tokens` cells, batches of `verifier.max_batch_tokens` rows (at most the
    cells), the calling thread's cores (the verifier's placement). What it cannot serve is
    refused before, by `device.check`. Draft heads served: its decodes return the rows' final
    hidden states too."""
    from specmesh_services.common import models
    from specmesh_services.common.drafts import serves_heads

    path = models.gguf_file(settings.model, settings.cache_dir)
    v = settings.verifier
    model = GgmlModel(path, n_ctx=v.kv_budget_tokens,
                      n_batch=min(v.max_batch_tokens, v.kv_budget_tokens),
                      n_seq_max=MAX_SEQUENCES, threads=len(os.sched_getaffinity(0)),
                      embeddings=serves_heads(settings))
    return GgmlLM(model, settings.model, model.context_length)
