"""A causal LM run over a per-request KV cache, with token trees as inputs.

Both the verifier (target) and the drafter (draft models) use it. `forward` appends rows to a
request's cache: a causal chain (prefill, catch-up) or tree nodes with a visibility mask, passed
to the `transformers` model as a 4D additive mask with per-row position ids. `KVCache.keep` is
the KV rollback: the accepted rows gathered behind the committed prefix, the rest dropped.
`forward_many` runs several requests' new rows as ONE `[1, T]` forward, attention per request
against its own cache through transformers' `AttentionInterface` (`CACHES_ATTN`): how the
drafter batches its draft forwards (Minions 3.4 / SPIN V.B; docs/drafters.md, Batched drafting).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specmesh_services.common.models import context_length

CACHES_ATTN = "specmesh-caches"


class KVCache:
    """One request's key/value rows (all layers) in a transformers DynamicCache."""

    def __init__(self, config) -> None:
        self.cache = DynamicCache(config=config)

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keeps rows [0, start) followed by `rows` (ascending, each >= start); drops the rest."""
        if any(r < start for r in rows) or list(rows) != sorted(rows):
            raise ValueError(f"rows to keep must be ascending and >= {start}: {list(rows)}")
        if list(rows) == list(range(start, start + len(rows))):
            self.truncate(start + len(rows))  # already contiguous: no copy
            return
        index = torch.cat([torch.arange(start), torch.tensor(list(rows), dtype=torch.long)])
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))

    def truncate(self, length: int) -> None:
        """Keeps the first `length` rows."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, len, head_dim] (for tests and debugging)."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]


@dataclass(frozen=True)
class Part:
    """One request's new rows in `CausalLM.forward_many`."""

    cache: KVCache
    tokens: torch.Tensor  # [n] long
    positions: torch.Tensor | None = None  # [n] long; default: a chain after the cache
    visible: torch.Tensor | None = None  # [n, len(cache) + n] bool; default: causal chain
    logits_from: int = 0  # rows >= this get logits (n: none, e.g. a catch-up chain)


@dataclass(frozen=True)
class _Rows:
    """A part as the attention function sees it: rows start..end of the packed input."""

    cache: DynamicCache
    start: int
    end: int
    mask: torch.Tensor | None  # [n, past + n] bool (True = attend), None: see causal
    causal: bool  # no mask: causal chain without past (True) or a single row (False)


def _caches_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      specmesh_rows: Sequence[_Rows] | None = None, **kwargs):
    """transformers attention function. query: [1, H, T, D]; key/value: [1, KVH, T, D], the new
    rows of every part (RoPE applied). Appends each part's K/V to its cache and attends its
    cache under its mask. Returns ([1, T, H, D], None)."""
    if specmesh_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    layer = module.layer_idx
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])  # [1, T, H, D]
    for r in specmesh_rows:
        k, v = r.cache.layers[layer].update(key[:, :, r.start:r.end], value[:, :, r.start:r.end])
        o = F.scaled_dot_product_attention(query[:, :, r.start:r.end], k, v, attn_mask=r.mask,
                                           is_causal=r.causal, scale=scaling, enable_gqa=gqa)
        out[0, r.start:r.end] = o[0].transpose(0, 1)
    return out, None


AttentionInterface.register(CACHES_ATTN, _caches_attention)


@contextlib.contextmanager
def attention_implementation(configs: Sequence, name: str) -> Iterator[None]:
    """Switches the models' attention function to `name` (registered with transformers'
    AttentionInterface) for the duration of a forward; the same model object keeps serving
    plain `generate` and `CausalLM.forward` otherwise."""
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, old in zip(configs, saved):
            c._attn_implementation = old


def model_configs(model) -> list:
    """Every distinct config object of a model's modules (what the attention switch touches)."""
    return list({id(c): c for c in (getattr(m, "config", None) for m in model.modules())
                 if c is not None}.values())


def part_layout(p: Part, device=None) -> tuple[int, int, torch.Tensor, torch.Tensor | None,
                                                bool]:
    """A part of `forward_many` checked and laid out for attention: (rows in its cache, new rows
    n, position ids [n], mask [n, past + n] bool or None, causal). No mask: a causal chain
    without past (causal True) or a single row (False)."""
    past, n = len(p.cache), int(p.tokens.shape[0])
    assert p.tokens.dim() == 1 and n > 0, "a part needs a 1-D, non-empty token tensor"
    assert 0 <= p.logits_from <= n, "logits_from must be in [0, n]"
    pos = p.positions if p.positions is not None else torch.arange(past, past + n)
    assert pos.shape == (n,), f"positions must be [{n}], got {tuple(pos.shape)}"
    if p.visible is not None:
        assert p.visible.shape == (n, past + n), \
            f"visible must be [{n}, {past + n}], got {tuple(p.visible.shape)}"
        return past, n, pos, p.visible.to(device), False
    if n == 1 or past == 0:
        return past, n, pos, None, n > 1
    # a chain after the cache: row i sees the cache and rows 0..i
    return past, n, pos, torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past), False


def split_logits(logits: torch.Tensor, parts: Sequence[Part]) -> list[torch.Tensor]:
    """The rows of `forward_many`'s logits that belong to each part (its rows >= logits_from)."""
    out, at = [], 0
    for p in parts:
        n = int(p.tokens.shape[0]) - p.logits_from
        out.append(logits[at:at + n])
        at += n
    return out


class CausalLM:
    """A transformers causal LM in inference mode plus what the mesh needs to know about it."""

    def __init__(self, model, name: str) -> None:
        self.model = model
        self.name = name
        config = model.config
        self.config = config
        self.vocab_size: int = config.vocab_size
        self.num_layers: int = config.num_hidden_layers
        self.context_length: int = context_length(config)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self._configs = model_configs(model)

    def new_cache(self) -> KVCache:
        return KVCache(self.config)

    @torch.inference_mode()
    def forward(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None, last: int = 0) -> torch.Tensor:
        """Runs `tokens` as new rows appended to `cache`; returns their logits [n, V] (float32).

        tokens: [n] long. positions: [n] long position ids (default: a chain after the cache).
        visible: [n, len(cache) + n] bool, row i may attend to column j (default: causal chain).
        last: only the last `last` rows' logits (0 = all): the LM head over a long prompt
        costs as much as several layers and a prefill needs one row.
        """
        past = len(cache)
        n = int(tokens.shape[0])
        assert tokens.dim() == 1 and n > 0, "forward needs a 1-D, non-empty token tensor"
        if positions is None:
            positions = torch.arange(past, past + n)
        assert positions.shape == (n,), f"positions must be [{n}], got {tuple(positions.shape)}"
        mask = None
        if visible is not None:
            assert visible.shape == (n, past + n), \
                f"visible must be [{n}, {past + n}], got {tuple(visible.shape)}"
            mask = torch.zeros(1, 1, n, past + n, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~visible.to(self.device), torch.finfo(self.dtype).min)
        out = self.model(
            input_ids=tokens.view(1, n).to(self.device),
            position_ids=positions.view(1, n).to(self.device),
            attention_mask=mask,
            past_key_values=cache.cache,
            cache_position=torch.arange(past, past + n, device=self.device),
            use_cache=True,
            logits_to_keep=last,
        )
        return out.logits[0].float()

    def prefill(self, cache: KVCache, tokens: Sequence[int]) -> torch.Tensor | None:
        """Appends a causal chain of tokens; returns the last row's logits [V] (None if empty)."""
        if not tokens:
            return None
        return self.forward(cache, torch.tensor(list(tokens), dtype=torch.long), last=1)[-1]

    @torch.inference_mode()
    def forward_many(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """Runs every part's rows, appended to its own cache, in one forward pass; returns per
        part the logits of its rows from `logits_from` on: [n - logits_from, V] float32. The
        parts must use distinct caches."""
        assert len({id(p.cache) for p in parts}) == len(parts), "one part per cache"
        rows, tokens, positions, keep, at = [], [], [], [], 0
        for p in parts:
            _, n, pos, mask, causal = part_layout(p, self.device)
            rows.append(_Rows(p.cache.cache, at, at + n, mask, causal))
            tokens.append(p.tokens)
            positions.append(pos)
            keep.append(torch.arange(at + p.logits_from, at + n))
            at += n
        ids = torch.cat(tokens).view(1, at).to(self.device)
        pos_ids = torch.cat(positions).view(1, at).to(self.device)
        keep_rows = torch.cat(keep)
        with attention_implementation(self._configs, CACHES_ATTN):
            if keep_rows.numel() == 0:  # catch-up chains only: skip the LM head
                self.model.model(input_ids=ids, position_ids=pos_ids, use_cache=False,
                                 specmesh_rows=rows)
                return [torch.empty(0, self.vocab_size) for _ in parts]
            logits = self.model(input_ids=ids, position_ids=pos_ids, use_cache=False,
                                logits_to_keep=keep_rows.to(self.device),
                                specmesh_rows=rows).logits[0].float()
        return split_logits(logits, parts)
