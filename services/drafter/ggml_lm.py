"""A draft model on llama.cpp's kernels: the `CausalLM` interface `DraftModel` drafts with, over
one llama.cpp context (its GGUF file as stored) whose unified KV cache holds every request.

A request's cache is a sequence id holding its committed rows (positions 0 .. n - 1). A tree
row gets a sequence of its own, copied from its parent's before it is decoded, so that it
attends to the committed prefix, its ancestors and itself and nothing else (the verifier's tree
encoding, services/verifier/ggml_batch.py, built level by level). `keep` moves the accepted
rows into the request's sequence and drops the other tree rows by their sequences. Every
request's rows of a drafting level run as one `llama_decode`.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specmesh_services.common.lm import Part
from specmesh_services.common.ggml_model import GgmlModel

__all__ = ["GgmlDraftCache", "GgmlDraftLM"]


class GgmlDraftCache:
    """One request's rows in the draft's llama.cpp cache: `rows[i]` = (position, the row's own
    sequence id or None for a committed row held by the request's sequence `seq`, its parent
    row or None)."""

    def __init__(self, lm: GgmlDraftLM) -> None:
        self.lm = lm
        self.seq = lm.take_sequence()
        self.rows: list[tuple[int, int | None, int | None]] = []
        self._owned = [self.seq]  # every sequence id of this cache, freed with it
        self._finalizer = weakref.finalize(self, lm.free_sequences, self._owned)

    def __len__(self) -> int:
        return len(self.rows)

    def committed(self) -> int:
        """Rows held by the request's sequence (the first rows, positions 0 .. n - 1): counted
        back over the tree rows after them, not over the whole context, on every level."""
        n = len(self.rows)
        while n and self.rows[n - 1][1] is not None:
            n -= 1
        return n

    def path(self, row: int) -> set[int]:
        """`row` and its tree ancestors."""
        out = set()
        while row is not None:
            out.add(row)
            row = self.rows[row][2]
        return out

    def tree_sequence(self) -> int:
        seq = self.lm.take_sequence()
        self._owned.append(seq)
        return seq

    def drop(self, rows: Sequence[tuple[int, int | None, int | None]]) -> None:
        """Frees the sequences of dropped tree rows (their cells with them)."""
        for _, seq, _ in rows:
            if seq is not None:
                self._owned.remove(seq)
                self.lm.free_sequences([seq])

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keeps rows [0, start) followed by `rows` (ascending, each >= start: an accepted path,
        positions start, start + 1, ...) as committed rows; drops the rest."""
        rows = list(rows)
        if any(r < start for r in rows) or rows != sorted(rows):
            raise ValueError(f"rows to keep must be ascending and >= {start}: {rows}")
        if start > self.committed():
            raise ValueError("ggml draft cache: rows before `start` must be committed")
        kept = [self.rows[r] for r in rows]
        positions = [pos for pos, _, _ in kept]
        if positions != list(range(start, start + len(kept))):
            raise ValueError(f"ggml draft cache: kept rows must follow position {start - 1} as "
                             f"a path, got positions {positions}")
        model = self.lm.model
        trees = [seq for _, seq, _ in kept if seq is not None]
        first_tree = start + len(kept) - len(trees)  # committed rows kept come first
        model.seq_remove(self.seq, first_tree)  # committed rows past them
        if trees:  # the deepest kept tree row's sequence holds its whole path
            model.seq_copy(trees[-1], self.seq, first_tree, start + len(kept))
        self.drop(self.rows[start:])
        self.rows = self.rows[:start] + [(pos, None, None) for pos in positions]

    def truncate(self, length: int) -> None:
        """Keeps the first `length` rows."""
        if length >= len(self.rows):
            return
        dropped = self.rows[length:]
        committed = [pos for pos, seq, _ in dropped if seq is None]
        if committed:
            self.lm.model.seq_remove(self.seq, min(committed))
        self.drop(dropped)
        del self.rows[length:]

    def close(self) -> None:
        """Frees the cache's cells and sequence ids now (also done when it is collected)."""
        self._finalizer()


class GgmlDraftLM:
    """A GGUF draft model run by llama.cpp, with `CausalLM`'s drafting interface (`new_cache`,
    `prefill`, `forward_many`). `token_ids`: the draft vocabulary's ids (`draft_vocab`), whose
    columns alone the logits keep; None: the whole vocabulary."""

    def __init__(self, path: Path, name: str, n_ctx: int, n_batch: int = 512,
                 n_seq_max: int = 256, threads: int | None = None,
                 token_ids: torch.Tensor | None = None) -> None:
        self.model = GgmlModel(path, n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                               n_seq_max=n_seq_max, threads=threads)
        self.name = name
        self.token_ids = token_ids
        self._columns = None if token_ids is None else token_ids.numpy()
        self.vocab_size = self.model.vocab_size
        self.context_length = self.model.context_length
        self.num_layers = _layers(self.model)
        self.dtype = torch.float32  # the logits'; the weights are the GGUF's own
        self.device = torch.device("cpu")
        self._free = list(range(n_seq_max - 1, -1, -1))  # pop() = lowest

    def take_sequence(self) -> int:
        if not self._free:
            raise ValueError(f"the ggml draft {self.name} has no free llama.cpp sequence "
                             f"(n_seq_max {self.model.n_seq_max}): too many requests or tree "
                             f"nodes at once")
        return self._free.pop()

    def free_sequences(self, seqs: list[int]) -> None:
        """Drops the sequences' cells and returns their ids (a cache's, when it is collected)."""
        if self.model.ctx is None:
            return
        for seq in seqs:
            self.model.seq_remove(seq)
            self._free.append(seq)

    def new_cache(self) -> GgmlDraftCache:
        return GgmlDraftCache(self)

    def prefill(self, cache: GgmlDraftCache, tokens: Sequence[int]) -> torch.Tensor | None:
        """Appends a causal chain of tokens; returns the last row's logits [V] (None if empty)."""
        if not tokens:
            return None
        return self.forward_many([Part(cache, torch.tensor(list(tokens), dtype=torch.long),
                                       logits_from=len(tokens) - 1)])[0][-1]

    def forward_many(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """Every part's rows appended to its own cache in one decode; per part the logits of
        its rows from `logits_from` on, [n - logits_from, V] float32. A part with `visible`
        adds tree rows, each seeing the committed rows up to its parent's path and that path
        (what `DraftModel._expand` asks); without, a chain of committed rows."""
        assert len({id(p.cache) for p in parts}) == len(parts), "one part per cache"
        before = [(p.cache, len(p.cache)) for p in parts]
        try:
            return self._forward(parts)
        except Exception:  # a refused mask or a failed decode: the caches as they were
            for cache, length in before:
                cache.truncate(length)
            raise

    def _forward(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        tokens, positions, seq_ids, outputs, counts = [], [], [], [], []
        for p in parts:
            cache, n = p.cache, int(p.tokens.shape[0])
            past = len(cache)
            pos = (list(range(past, past + n)) if p.positions is None
                   else p.positions.tolist())
            if p.visible is None:
                if cache.committed() != past:
                    raise ValueError("ggml draft cache: a chain after tree rows")
                rows = [(q, None, None) for q in pos]
                seqs = [[cache.seq]] * n
            else:
                rows, seqs = self._tree_rows(cache, p.visible, pos)
            cache.rows.extend(rows)
            tokens += p.tokens.tolist()
            positions += pos
            seq_ids += seqs
            outputs += [i >= p.logits_from for i in range(n)]
            counts.append(n - p.logits_from)
        logits = self.model.decode(tokens, positions, seq_ids, outputs)  # [0, V]: no outputs
        if self._columns is not None:
            logits = logits[:, self._columns]
        return list(torch.from_numpy(np.ascontiguousarray(logits)).split(counts))

    def _tree_rows(self, cache: GgmlDraftCache, visible: torch.Tensor, positions: list[int]
                   ) -> tuple[list[tuple[int, int, int | None]], list[list[int]]]:
        """Sequences of new tree rows: each a fresh id copied from its parent's (the deepest
        earlier tree row it sees; none: the request's sequence), so the row sees exactly the
        committed rows, its path and itself. Raises ValueError for a mask that is not such a
        path (the drafting engine never asks one)."""
        past, committed = len(cache), cache.committed()
        parents = []
        for i in range(len(positions)):
            sees = set(visible[i].nonzero().flatten().tolist())
            earlier = [j for j in sees if committed <= j < past]
            parent = max(earlier, key=lambda j: cache.rows[j][0]) if earlier else None
            path = cache.path(parent) if parent is not None else set()
            if sees != set(range(committed)) | path | {past + i}:
                raise ValueError("ggml draft: a tree row must see the committed rows, its "
                                 "ancestors and itself only")
            parents.append(parent)
        rows, seqs = [], []
        try:
            for pos, parent in zip(positions, parents):
                seq = cache.tree_sequence()
                rows.append((pos, seq, parent))
                seqs.append([seq])
                source = cache.seq if parent is None else cache.rows[parent][1]
                self.model.seq_copy(source, seq, -1, pos)
        except ValueError:  # out of sequence ids: give back those taken
            cache.drop(rows)
            raise
        return rows, seqs

    def close(self) -> None:
        self.model.close()


def _layers(model: GgmlModel) -> int:
    lc = model._lc
    return int(lc.llama_model_n_layer(model.model))
