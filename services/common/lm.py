"""A causal LM run over a per-request KV cache, with token trees as inputs.

Both the verifier (target) and the drafter (draft models) use it. `forward` appends rows to a
request's cache: a plain causal chain (prefill, catch-up) or tree nodes with an explicit
visibility mask, passed to the `transformers` model as a 4D additive attention mask with
per-row position ids (DESIGN.md, "Facts checked"). `KVCache.keep` is the KV rollback: it gathers
the accepted rows to the end of the committed prefix and drops everything after.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from services.common.models import context_length


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

    def new_cache(self) -> KVCache:
        return KVCache(self.config)

    @torch.inference_mode()
    def forward(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """Runs `tokens` as new rows appended to `cache`; returns their logits [n, V] (float32).

        tokens: [n] long. positions: [n] long position ids (default: a chain after the cache).
        visible: [n, len(cache) + n] bool, row i may attend to column j (default: causal chain).
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
        )
        return out.logits[0].float()

    def prefill(self, cache: KVCache, tokens: Sequence[int]) -> torch.Tensor | None:
        """Appends a causal chain of tokens; returns the last row's logits [V] (None if empty)."""
        if not tokens:
            return None
        return self.forward(cache, torch.tensor(list(tokens), dtype=torch.long))[-1]
