"""A lean decoder loop for Llama / Qwen2 models: the forward without transformers' per-layer
machinery, shared by the drafter (draft models over per-request buffers) and the verifier (the
target over the paged KV store).

`LeanDecoder` computes what transformers' decoder does, with q/k/v and gate/up fused where the
weights are of one kind (`fuse_key`), rotary embeddings on q and k together, the elementwise
steps between the products in torch or fused Triton kernels (`ops`: kernels/decoder_ops.py),
attention through the caller's `Attend` (it stores K/V in the caller's layout, or `run`'s
`store` names where the decoder writes them) and the final
hidden states of the logit rows returned for draft heads; its numbers equal transformers' up
to float rounding
(tests/test_lean_draft.py, tests/test_lean_target.py). `supports` says why an architecture is
not covered. Why not transformers' forward: docs/decisions/lean-target-forward.md.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from specmesh_kernels import decoder_ops
from specmesh_services.common.models import context_length

ARCHITECTURES = ("llama", "qwen2")

# attend(layer, q [T, H, d], k [T, KVH, d], v [T, KVH, d]) -> attention output [T, H, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# store(layer) -> (k_cache, v_cache, slots [T]): where layer's new K/V rows go, written with RoPE
Store = Callable[[int], decoder_ops.KVStore]
# keep(x [T, hidden] after the first n layers) -> [T] bool rows that go on (None: all)
Prune = Callable[[torch.Tensor], "torch.Tensor | None"]


def supports(model) -> str | None:
    """None when `LeanDecoder` reproduces this transformers causal LM's decoder, else why not."""
    config = model.config
    if config.model_type not in ARCHITECTURES:
        return f"architecture {config.model_type} (the lean forward covers " \
               f"{', '.join(ARCHITECTURES)})"
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


def fuse(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One float nn.Linear computing `linears` side by side (their outputs concatenated)."""
    if len(linears) == 1:
        return linears[0]
    weight = torch.cat([m.weight.detach() for m in linears])
    fused = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0],
                               bias=any(m.bias is not None for m in linears), dtype=weight.dtype,
                               device=weight.device)
    fused.weight.data = weight
    if fused.bias is not None:
        fused.bias.data = torch.cat([m.bias.detach() if m.bias is not None
                                     else weight.new_zeros(m.out_features) for m in linears])
    return fused


def _runs(linears: Sequence[nn.Linear], key: Callable[[nn.Linear], object] | None
          ) -> list[list[nn.Linear]]:
    """`linears` split into consecutive runs of equal `key` (one run when key is None)."""
    if key is None:
        return [list(linears)]
    runs: list[list[nn.Linear]] = []
    last = object()
    for m in linears:
        k = key(m)
        if runs and k == last:
            runs[-1].append(m)
        else:
            runs.append([m])
        last = k
    return runs


def _concatenated(parts: Sequence[Callable[[torch.Tensor], torch.Tensor]]
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    return lambda x: torch.cat([p(x) for p in parts], dim=-1)


Linear = Callable[[torch.Tensor], torch.Tensor]


def _split(decode: Linear, prefill: Linear, prompt: torch.Tensor | int | None,
           other: torch.Tensor) -> Linear:
    """A product whose prompt rows go through `prefill` and the other rows through `decode`,
    each call on its own rows. `prompt`: the prompt rows' indices, or n (the first n rows: a
    lone request's prompt before its tree, read as slices), or None (every row)."""
    if prompt is None:
        return prefill
    if isinstance(prompt, int):
        n = prompt
        return lambda x: torch.cat([prefill(x[:n]), decode(x[n:])])

    def call(x: torch.Tensor) -> torch.Tensor:
        a, b = prefill(x[prompt]), decode(x[other])
        y = a.new_empty(x.shape[0], a.shape[-1])
        y[prompt], y[other] = a, b
        return y
    return call


class LeanDecoder:
    """A Llama / Qwen2 causal LM's decoder as a plain loop over its layers (module docstring).

    Built from a transformers model with torch's own linears (its head may be a `SubsetHead`);
    `prepare(linears)` converts the fused linears in place (a ModuleDict: quantize, pack for
    oneDNN...), and `fuse_key(linear)` keeps layers with different keys in separate products.
    `ops`: the elementwise steps' kernels (decoder_ops.CHOICES; auto = Triton on CUDA). The
    transformers model is not kept."""

    def __init__(self, model, name: str, prepare: Callable[[nn.ModuleDict], object] | None = None,
                 fuse_key: Callable[[nn.Linear], object] | None = None, ops: str = "auto"
                 ) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not cover this model: {reason}")
        config = model.config
        self.name = name
        self.config = config
        self.vocab_size: int = config.vocab_size
        self.num_layers: int = config.num_hidden_layers
        self.context_length: int = context_length(config)
        base = model.model
        self.dtype: torch.dtype = base.embed_tokens.weight.dtype
        self.device = base.embed_tokens.weight.device
        self.ops = decoder_ops.select(ops, self.device)
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
        runs: dict[str, list[str]] = {}
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for part, members in (("qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
                                  ("o", [attn.o_proj]),
                                  ("gate_up", [mlp.gate_proj, mlp.up_proj]),
                                  ("down", [mlp.down_proj])):
                names = runs[f"{i}_{part}"] = []
                for j, run in enumerate(_runs(members, fuse_key)):
                    names.append(f"{i}_{part}_{j}")
                    linears[names[-1]] = fuse(run)
            self.norms.append((layer.input_layernorm.weight.detach(),
                               layer.post_attention_layernorm.weight.detach()))
        self.final_norm = base.norm.weight.detach()
        head = model.get_output_embeddings()
        self.token_ids: torch.Tensor | None = None  # column -> token id (None: identity)
        if hasattr(head, "keep") and hasattr(head, "proj"):  # a SubsetHead (drafter/vocab.py)
            self.token_ids = head.keep.clone()
            head = head.proj
        linears["head"] = head
        if prepare is not None:
            prepare(linears)
        self.linears = linears

        def call(key: str, prefill: bool = False) -> Linear:
            return _concatenated([getattr(linears[n], "prefill", linears[n].forward) if prefill
                                  else linears[n].forward for n in runs[key]])

        parts = ("qkv", "o", "gate_up", "down")
        self.layers = [tuple(call(f"{i}_{part}") for part in parts)
                       for i in range(self.num_layers)]
        # products with another form for prompt rows (a native target's int4 layers keep a
        # dense copy: the int4 kernel's cost grows steeply with the rows)
        self.prefill_layers = None
        if any(hasattr(m, "prefill") for m in linears.values()):
            self.prefill_layers = [tuple(call(f"{i}_{part}", True) for part in parts)
                                   for i in range(self.num_layers)]
        self.head = linears["head"].forward

    @property
    def columns(self) -> int:
        return self.vocab_size if self.token_ids is None else int(self.token_ids.numel())

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos.to(self.dtype)[:, None], sin.to(self.dtype)[:, None]  # [T, 1, D]

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
            rows: torch.Tensor | None, prompt: torch.Tensor | int | None = None,
            prune: tuple[int, Prune] | None = None, store: Store | None = None
            ) -> torch.Tensor | None:
        """The decoder over T new rows (`tokens`, `positions`: [T] long on the model's device),
        attention by `attend`; returns the final (normalized) hidden states of `rows` [R,
        hidden] (None: no rows need them, e.g. prefill chunks: the final norm is skipped).
        `prompt`: the rows that are prompt (prefill) rows, through the products' prefill form
        where they have one: indices, or n for the first n rows; the others are `rows` (None:
        every row is a prompt row when `rows` is empty, else none is).
        `prune` = (n, keep): after layer n, `keep(x)` may return which rows go on ([T] bool;
        None: all): the later layers run on those only (`attend` then sees only them, so
        `keep` switches it too), and the result holds the kept rows of `rows`, in order.
        Prompt rows must be kept. `store`: each layer's K/V written to its paged cache with
        RoPE (one launch with the fused ops), `attend` then only reads them (not with `prune`)."""
        assert store is None or prune is None, "a pruned run's rows change mid-forward"
        everything = rows is None or rows.numel() == 0
        layers = self._layers(rows, prompt, everything)
        x = self.embed[tokens]  # [T, hidden]
        cos, sin = self._rope(positions.to(self.inv_freq.device))
        cos, sin = cos.to(x.device), sin.to(x.device)
        delta = None  # the last layer's MLP output, added to x with the next norm
        for i in range(self.num_layers):
            if prune is not None and i == prune[0]:
                if delta is not None:
                    x, delta = x + delta, None
                alive = prune[1](x)
                if alive is not None:
                    x, cos, sin = x[alive], cos[alive], sin[alive]
                    index = torch.cumsum(alive, 0) - 1  # old row -> new row
                    if not everything:
                        rows = index[rows[alive[rows]]]
                    if isinstance(prompt, torch.Tensor):
                        prompt = index[prompt]
                    layers = self._layers(rows, prompt, everything)
            x, delta = self._layer(i, layers[i], x, delta, cos, sin, attend,
                                   None if store is None else store(i))
        if everything or rows.numel() == 0:
            return None
        return self.ops.add_norm(x[rows], None if delta is None else delta[rows],
                                 self.final_norm, self.eps)[1]

    def _layers(self, rows: torch.Tensor | None, prompt: torch.Tensor | int | None,
                everything: bool) -> list[tuple[Linear, ...]]:
        """Each layer's products for these rows (prompt rows through the prefill forms)."""
        if self.prefill_layers is None or not (everything or prompt is not None):
            return self.layers
        split = None if everything else prompt
        return [tuple(_split(d, p, split, rows) for d, p in zip(decode, prefill))
                for decode, prefill in zip(self.layers, self.prefill_layers)]

    def _layer(self, i: int, products: tuple[Linear, ...], x: torch.Tensor,
               delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
               store: decoder_ops.KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i over x + delta (the residual stream, the last layer's MLP output not yet
        added): returns the stream after attention and this layer's MLP output."""
        qkv_proj, o_proj, gate_up_proj, down_proj = products
        t, heads, ops = int(x.shape[0]), self.heads, self.ops
        norm_in, norm_post = self.norms[i]
        x, h = ops.add_norm(x, delta, norm_in, self.eps)
        q, k, v = ops.rope(qkv_proj(h), heads, self.kv_heads, cos, sin, store)
        out = attend(i, q, k, v)  # [T, H, d]
        x, h = ops.add_norm(x, o_proj(out.reshape(t, heads * self.head_dim)), norm_post,
                            self.eps)
        return x, down_proj(ops.silu_mul(gate_up_proj(h)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, columns] of final hidden states [R, hidden]."""
        return self.head(hidden).float()
