"""The drafter's lean forward: the shared decoder loop (common/lean.py) over per-request KV
buffers, implementing the part of `CausalLM` a `DraftModel` uses (`new_cache`, `prefill`,
`forward_many`) with the same semantics, logits over the draft vocabulary only (`token_ids`).

Keys and values live in preallocated per-request buffers (`LeanKV`, grown by doubling; rollback
is an index copy inside the buffer). A draft only has to guess: its numbers may differ from
transformers' by float rounding (tests/test_lean_draft.py). Where `supports` says the
architecture is not covered the drafter keeps transformers' forward (`Settings.draft_runner`;
why: docs/decisions/lean-draft-forward.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specmesh_services.common.lean import LeanDecoder, supports
from specmesh_services.common.lm import Part, part_layout, split_logits

__all__ = ["LeanKV", "LeanLM", "supports"]


class LeanKV:
    """One request's keys and values, all layers, in preallocated buffers
    [layers, kv_heads, capacity, head_dim]; rows [0, len) are valid."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 256, device: torch.device | str = "cpu") -> None:
        self.shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.empty(self.shape, dtype=dtype, device=device)
        self.values = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        """Room for `length` rows (capacity doubled until it fits; valid rows copied)."""
        capacity = self.keys.shape[2]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keeps rows [0, start) followed by `rows` (ascending, each >= start); drops the rest
        (the same contract as `KVCache.keep`)."""
        rows = list(rows)
        if any(r < start for r in rows) or rows != sorted(rows):
            raise ValueError(f"rows to keep must be ascending and >= {start}: {rows}")
        if rows != list(range(start, start + len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
            for buf in (self.keys, self.values):
                buf[:, :, start:start + len(rows)] = buf.index_select(2, index)
        self.length = start + len(rows)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, len, head_dim] (tests, debugging)."""
        return [(self.keys[i, None, :, :self.length], self.values[i, None, :, :self.length])
                for i in range(self.keys.shape[0])]


class LeanLM(LeanDecoder):
    """A draft model's decoder loop over `LeanKV` buffers (module docstring). `prepare` converts
    the fused linears the way the drafter would have converted the model's
    (`quantize_linears` / `pack_linears`)."""

    def new_cache(self) -> LeanKV:
        return LeanKV(self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                      device=self.device)

    def forward(self, cache: LeanKV, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None, last: int = 0) -> torch.Tensor:
        """`CausalLM.forward`: `tokens` appended to `cache`; logits [n or last, columns]."""
        n = int(tokens.shape[0])
        from_row = max(0, n - last) if last else 0
        return self.forward_many([Part(cache, tokens, positions, visible, from_row)])[0]

    def prefill(self, cache: LeanKV, tokens: Sequence[int]) -> torch.Tensor | None:
        """Appends a causal chain of tokens; returns the last row's logits (None if empty)."""
        if not tokens:
            return None
        ids = torch.tensor(list(tokens), dtype=torch.long)
        return self.forward_many([Part(cache, ids, logits_from=len(ids) - 1)])[0][-1]

    @torch.inference_mode()
    def forward_many(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """`CausalLM.forward_many`: every part's rows appended to its own cache in one pass;
        per part the logits [n - logits_from, columns] (float32) of rows >= logits_from, over
        the draft vocabulary's columns (`token_ids`)."""
        assert len({id(p.cache) for p in parts}) == len(parts), "one part per cache"
        spans, tokens, positions, keep, at = [], [], [], [], 0
        for p in parts:
            past, n, pos, mask, causal = part_layout(p, self.device)
            p.cache.reserve(past + n)
            spans.append((p.cache, at, at + n, past, mask, causal))
            tokens.append(p.tokens)
            positions.append(pos)
            keep.append(torch.arange(at + p.logits_from, at + n))
            at += n
        gqa = self.heads != self.kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = q.new_empty(q.shape)
            for cache, start, end, past, mask, causal in spans:
                stop = past + end - start
                keys, values = cache.keys[i], cache.values[i]  # [KVH, capacity, d]
                keys[:, past:stop] = k[start:end].transpose(0, 1)
                values[:, past:stop] = v[start:end].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None], keys[None, :, :stop],
                    values[None, :, :stop], attn_mask=mask, is_causal=causal, scale=self.scale,
                    enable_gqa=gqa)
                out[start:end] = o[0].transpose(0, 1)
            return out

        device = self.device
        rows = torch.cat(keep).to(device)
        hidden = self.run(torch.cat(tokens).to(device), torch.cat(positions).to(device), attend,
                          rows)
        for cache, start, end, past, _, _ in spans:
            cache.length = past + end - start
        if hidden is None:
            return [torch.empty(0, self.columns, device=self.device) for _ in parts]
        return split_logits(self.logits(hidden), parts)
