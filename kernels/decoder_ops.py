"""The lean decoder's elementwise steps (services/common/lean.py), in torch or fused in Triton.

Between its four products a Llama / Qwen2 layer runs a residual add and RMSNorm twice, RoPE on
q and k, and SiLU(gate) x up: in torch ~18 small kernels a layer, each a launch that costs more
than its work on a GPU, even replayed from a CUDA graph. `TritonOps` runs each step as one
kernel (vLLM's fused_add_rms_norm, rotary_embedding and silu_and_mul; RoPE also writes the new
K/V rows to a paged cache where the caller gives one, as vLLM's reshape_and_cache): about 9
launches a layer with the products and attention. `TorchOps` is the reference and the CPU
path: the same ops in the same order as transformers' decoder. Both round where torch rounds
(the model's dtype after every op, normalization in float32), so bf16 results agree to the bit
but for the norm's reduction order and exp's last float32 bit (tests/test_decoder_ops.py).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

CHOICES = ("auto", "torch", "triton")
# where a layer's new K/V rows go: k_cache, v_cache [num_slots, KVH, d] and the rows' slots [T]
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TorchOps:
    """The elementwise steps as torch ops (module docstring)."""

    name = "torch"

    @staticmethod
    def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * weight); x [T, hidden], delta None: x as it is."""
        if delta is not None:
            x = x + delta
        if x.dtype == torch.float32:
            return x, F.rms_norm(x, (x.shape[-1],), weight, eps)
        # transformers normalizes in float32 and scales in the model's dtype
        return x, weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    @staticmethod
    def rope(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
             store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, d], k [T, KVH, d] rotated and v [T, KVH, d] of a fused q/k/v product
        [T, (H + 2 KVH) d]; cos, sin [T, 1, d] in the model's dtype. `store`: k and v also
        written to the caches' slots."""
        t, d = int(qkv.shape[0]), int(cos.shape[-1])
        width, half = (heads + kv_heads) * d, d // 2
        qk = qkv[:, :width].view(t, heads + kv_heads, d)
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + rotated * sin  # RoPE on q and k at once
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, width:].view(t, kv_heads, d)
        if store is not None:
            k_cache, v_cache, slots = store
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return q, k, v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a fused gate/up product [T, 2 I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def select(choice: str, device: torch.device) -> type:
    """The ops class for `choice` (CHOICES; auto = Triton on CUDA, torch elsewhere). Triton off
    CUDA runs only in its interpreter (TRITON_INTERPRET=1: tests)."""
    if choice not in CHOICES:
        raise ValueError(f"decoder ops {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "torch":
        return TorchOps
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"decoder ops triton need CUDA (device is {device.type}); on the CPU "
                         f"they run only under TRITON_INTERPRET=1 (tests)")
    from specmesh_kernels.decoder_triton import TritonOps  # lazy: imports triton

    return TritonOps
