"""A draft model's lean forward over a paged KV store, its steps replayed from CUDA graphs.

On CUDA a one-row drafting forward is bound by its kernel launches, as the verifier's step is
(docs/gpu.md). `PagedLM` keeps every request's draft rows in one block-allocated store
(common/kv.py) instead of per-request buffers (`LeanKV`), so a forward is the verifier's
bucketed step (common/graphs.py): padded to a bucket of rows, its inputs staged in persistent
buffers, replayed from a graph captured once per bucket. A tree level's rows see the committed
rows, the root and their own ancestors among the levels before: a mask over the request's
rows from the root on, wider than the level (`Segment.mask` [n, W]). Parts the buckets do not
cover (a long prefill, a long context's split past the item table) run eagerly over the same
kernels. Semantics are `LeanLM`'s (`new_cache`, `prefill`, `forward_many`): the drafts are the
same up to float rounding (tests/test_paged_draft.py).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from specmesh_services.common.graphs import StepGraphs
from specmesh_services.common.kv import KVStore, Segment
from specmesh_services.common.lm import Part, part_layout
from specmesh_services.common.rpc import Overloaded
from specmesh_services.drafter.engine import MAX_DEPTH, MAX_WIDTH
from specmesh_services.drafter.lean import LeanLM

__all__ = ["PagedKV", "PagedLM"]

BLOCK_SIZE = 16  # the store's allocation unit (rows), the verifier's default


class PagedKV:
    """One request's draft rows in the shared store: `LeanKV`'s contract (`len`, `reserve`,
    `keep`, `truncate`) plus `free`, which returns its blocks (the drafter calls it when the
    request is released or prefilled again)."""

    def __init__(self, store: KVStore, key: str) -> None:
        self.store, self.key = store, key

    def __len__(self) -> int:
        return self.store.length(self.key)

    def reserve(self, length: int) -> None:
        if not self.store.reserve(self.key, length):
            raise Overloaded(f"the draft KV store is full ({self.store.capacity} rows, "
                             f"{len(self.store.seqs)} requests held): raise "
                             "verifier.kv_budget_tokens or send fewer requests at once")

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keeps rows [0, start) followed by `rows` (ascending, each >= start)."""
        rows = list(rows)
        if any(r < start for r in rows) or rows != sorted(rows):
            raise ValueError(f"rows to keep must be ascending and >= {start}: {rows}")
        if self.key not in self.store.seqs:
            assert start == 0 and not rows, "rows kept that were never written"
            return
        self.store.commit(self.key, start, [r - start for r in rows])

    def truncate(self, length: int) -> None:
        if self.key in self.store.seqs and length < len(self):
            self.store.set_length(self.key, length)
            self.store.truncate_blocks(self.key)

    def free(self) -> None:
        self.store.free(self.key)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, len, head_dim] (tests, debugging)."""
        if not len(self):
            shape = (1, self.store.k.shape[2], 0, self.store.k.shape[3])
            return [(self.store.k.new_empty(shape),) * 2 for _ in range(self.store.k.shape[0])]
        slots = self.store.slots(self.key, 0, len(self)).to(self.store.k.device)
        return [(k.index_select(0, slots).transpose(0, 1)[None],
                 v.index_select(0, slots).transpose(0, 1)[None])
                for k, v in zip(self.store.k, self.store.v)]


class PagedLM(LeanLM):
    """A draft model's decoder loop over a paged store, bucketed and graph-replayed where the
    device is CUDA (module docstring). `capacity_tokens`: the store's rows for all requests;
    `max_rows`: the largest bucket; `capture`: replay graphs (default: on CUDA)."""

    def __init__(self, model, name: str, capacity_tokens: int, max_rows: int = 256,
                 capture: bool | None = None, prepare=None, ops: str = "auto") -> None:
        super().__init__(model, name, prepare=prepare, ops=ops)
        if max_rows < MAX_WIDTH:
            raise ValueError(f"draft graph rows must hold a tree level ({MAX_WIDTH} rows), "
                             f"got {max_rows}")
        compact = None  # the store's default: torch's index copies
        if self.device.type == "cuda":
            from specmesh_kernels.compaction import compact_kv_triton as compact
        self.store = KVStore(self.num_layers, self.kv_heads, self.head_dim, capacity_tokens,
                             BLOCK_SIZE, self.dtype, self.device, compact=compact)
        # a level's mask spans the tree so far and the level: MAX_DEPTH x MAX_WIDTH rows at most
        self.graphs = StepGraphs(self, self.store, max_rows, capture=capture,
                                 mask_width=MAX_DEPTH * MAX_WIDTH + max_rows,
                                 capture_mode="thread_local")
        self._keys = itertools.count()

    def new_cache(self) -> PagedKV:
        return PagedKV(self.store, f"draft-{next(self._keys)}")

    def capture_all(self) -> float:
        """Captures every bucket's graph now (else each at first use); seconds, 0 off CUDA."""
        return self.graphs.capture_all() if self.graphs.capture else 0.0

    @torch.inference_mode()
    def forward_many(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """`CausalLM.forward_many` (LeanLM's): each part's logits [n - logits_from, columns]
        float32 over the draft vocabulary. Parts that fit a bucket run through the bucketed
        step (all their rows get logits there; the rows asked for are returned), in groups
        that fit; the others together in one eager step."""
        assert len({id(p.cache) for p in parts}) == len(parts), "one part per cache"
        segments = [self._segment(p) for p in parts]
        graphed = [dataclasses.replace(s, logits_from=0) for s in segments]  # all rows' logits
        out: list[torch.Tensor | None] = [None] * len(parts)
        fits = [self.graphs.covers([s]) for s in graphed]
        eager = [i for i, fit in enumerate(fits) if not fit]
        group: list[int] = []
        for i in (i for i, fit in enumerate(fits) if fit):
            if group and not self.graphs.covers([graphed[j] for j in group + [i]]):
                self._replay(group, graphed, parts, out)
                group = []
            group.append(i)
        if group:
            self._replay(group, graphed, parts, out)
        if eager:
            for i, logits in zip(eager, self.graphs.eager([segments[i] for i in eager])):
                out[i] = logits
        for p, s in zip(parts, segments):
            self.store.set_length(p.cache.key, s.start + s.num_rows)
        return out

    def _replay(self, group: list[int], segments: list[Segment], parts: Sequence[Part],
                out: list) -> None:
        logits, _ = self.graphs.forward([segments[i] for i in group])
        for i, rows in zip(group, logits):
            out[i] = rows[parts[i].logits_from:].clone()  # the step's buffers are reused

    def _segment(self, p: Part) -> Segment:
        """The part as a segment of the store: its rows reserved; a tree level's mask cut to the
        positions from the first one some row does not see (the ones before: all visible)."""
        past, n, positions, visible, causal = part_layout(p)
        p.cache.reserve(past + n)
        if visible is None:  # a chain after the cache (or a single row)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            hidden = (~visible[:, :past].all(0)).nonzero()
            first = int(hidden[0]) if hidden.numel() else past
            mask = visible[:, first:].contiguous()
        return Segment(p.cache.key, past, p.tokens, positions.long(), mask, p.logits_from)

