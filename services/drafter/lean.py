"""A lean decoder loop for draft models: the drafting forward without transformers' per-layer
machinery.

Why: a draft's forward at batch 1 is a few rows through every layer, so its time is the weights'
bytes plus a fixed cost per operation, and transformers' modules spend about half of a drafting
level outside the matrix products (docs/decisions/lean-draft-forward.md).

`LeanLM` runs the same computation with:
- q/k/v and gate/up fused into one product each (4 quantized products per layer instead of 7:
  the same weights, fewer and larger kernel calls),
- rotary embeddings applied to q and k together, once per layer,
- keys and values written into preallocated per-request buffers (`LeanKV`, grown by doubling;
  rollback is an index copy inside the buffer),
- logits over the draft vocabulary only, with `token_ids` mapping a logit's column to its token
  id (`DraftModel` maps them; None: the whole vocabulary).

It implements the part of `CausalLM` a `DraftModel` uses (`new_cache`, `prefill`, `forward_many`)
with the same semantics (rows appended per request, per-part visibility masks, `logits_from`),
for the architectures whose decoder layer it reproduces: Llama and Qwen2 (RMSNorm, default RoPE,
SiLU-gated MLP, grouped-query attention, q/k/v biases where the model has them), no sliding
window. A draft only has to guess: its numbers may differ from transformers' by float rounding
(fused products, `F.rms_norm`), which `tests/test_lean_draft.py` bounds. The target never runs
here. Where the architecture is not covered `supports` says why and the drafter keeps
transformers' forward (`Settings.draft_runner`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specmesh_services.common.lm import Part, part_layout, split_logits
from specmesh_services.common.models import context_length

ARCHITECTURES = ("llama", "qwen2")


def supports(model) -> str | None:
    """None when `LeanLM` reproduces this transformers causal LM's decoder, else the reason."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type} (lean drafts cover {', '.join(ARCHITECTURES)})"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"RoPE type {rope.get('rope_type')}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


class LeanKV:
    """One request's keys and values, all layers, in preallocated buffers
    [layers, kv_heads, capacity, head_dim]; rows [0, len) are valid."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 256) -> None:
        self.shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.empty(self.shape, dtype=dtype)
        self.values = torch.empty(self.shape, dtype=dtype)
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
            index = torch.tensor(rows, dtype=torch.long)
            for buf in (self.keys, self.values):
                buf[:, :, start:start + len(rows)] = buf.index_select(2, index)
        self.length = start + len(rows)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, len, head_dim] (tests, debugging)."""
        return [(self.keys[i, None, :, :self.length], self.values[i, None, :, :self.length])
                for i in range(self.keys.shape[0])]


def _fuse(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One float nn.Linear computing `linears` side by side (their outputs concatenated)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    fused = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0],
                               bias=any(m.bias is not None for m in linears), dtype=weight.dtype)
    fused.weight.data = weight
    if fused.bias is not None:
        fused.bias.data = torch.cat([m.bias.detach() if m.bias is not None
                                     else weight.new_zeros(m.out_features) for m in linears])
    return fused


class LeanLM:
    """A draft model's decoder as a plain loop over its layers (module docstring).

    Built from a transformers Llama / Qwen2 causal LM with torch's own linears (its head may be a
    `SubsetHead`); `prepare` converts the fused linears the way the drafter would have converted
    the model's (`quantize_linears` / `pack_linears`). The transformers model is not kept."""

    def __init__(self, model, name: str, prepare=None) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"lean drafts do not cover this model: {reason}")
        config = model.config
        self.name = name
        self.config = config
        self.vocab_size: int = config.vocab_size
        self.num_layers: int = config.num_hidden_layers
        self.context_length: int = context_length(config)
        base = model.model
        self.dtype: torch.dtype = base.embed_tokens.weight.dtype
        self.device = base.embed_tokens.weight.device
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = base.embed_tokens.weight.detach()
        rotary = base.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        linears = nn.ModuleDict()
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears[f"{i}_qkv"] = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            linears[f"{i}_o"] = attn.o_proj
            linears[f"{i}_gate_up"] = _fuse([mlp.gate_proj, mlp.up_proj])
            linears[f"{i}_down"] = mlp.down_proj
            self.norms.append((layer.input_layernorm.weight.detach(),
                               layer.post_attention_layernorm.weight.detach()))
        self.final_norm = base.norm.weight.detach()
        head = model.get_output_embeddings()
        self.token_ids: torch.Tensor | None = None  # column -> token id (None: identity)
        if hasattr(head, "keep") and hasattr(head, "proj"):  # a SubsetHead (vocab.py)
            self.token_ids = head.keep.clone()
            head = head.proj
        linears["head"] = head
        if prepare is not None:
            prepare(linears)
        self.linears = linears
        self.layers = [(linears[f"{i}_qkv"].forward, linears[f"{i}_o"].forward,
                        linears[f"{i}_gate_up"].forward, linears[f"{i}_down"].forward)
                       for i in range(self.num_layers)]
        self.head = linears["head"].forward

    def new_cache(self) -> LeanKV:
        return LeanKV(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # transformers normalizes in float32 and scales in the model's dtype
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos.to(self.dtype)[:, None], sin.to(self.dtype)[:, None]  # [T, 1, D]

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
            past, n, pos, mask, causal = part_layout(p)
            p.cache.reserve(past + n)
            spans.append((p.cache, at, at + n, past, mask, causal))
            tokens.append(p.tokens)
            positions.append(pos)
            keep.append(torch.arange(at + p.logits_from, at + n))
            at += n
        x = self.embed[torch.cat(tokens)]  # [T, hidden]
        cos, sin = self._rope(torch.cat(positions))
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qk_width, half = (heads + kv_heads) * d, d // 2
        gqa = heads != kv_heads
        out = x.new_empty(at, heads, d)
        for i, (qkv_proj, o_proj, gate_up_proj, down_proj) in enumerate(self.layers):
            norm_in, norm_post = self.norms[i]
            qkv = qkv_proj(self._norm(x, norm_in))  # [T, (H + 2 KVH) d]
            qk = qkv[:, :qk_width].view(at, heads + kv_heads, d)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin  # RoPE on q and k at once: [T, H + KVH, d]
            v = qkv[:, qk_width:].view(at, kv_heads, d)
            for cache, start, end, past, mask, causal in spans:
                stop = past + end - start
                keys, values = cache.keys[i], cache.values[i]  # [KVH, capacity, d]
                keys[:, past:stop] = qk[start:end, heads:].transpose(0, 1)
                values[:, past:stop] = v[start:end].transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    qk[start:end, :heads].transpose(0, 1)[None], keys[None, :, :stop],
                    values[None, :, :stop], attn_mask=mask, is_causal=causal, scale=self.scale,
                    enable_gqa=gqa)
                out[start:end] = o[0].transpose(0, 1)
            x = x + o_proj(out.view(at, heads * d))
            gate, up = gate_up_proj(self._norm(x, norm_post)).chunk(2, dim=-1)
            x = x + down_proj(F.silu(gate) * up)
        for cache, start, end, past, _, _ in spans:
            cache.length = past + end - start
        rows = torch.cat(keep)
        if rows.numel() == 0:
            return [torch.empty(0, self.columns) for _ in parts]
        return split_logits(self.head(self._norm(x[rows], self.final_norm)).float(), parts)

    @property
    def columns(self) -> int:
        return self.vocab_size if self.token_ids is None else int(self.token_ids.numel())
