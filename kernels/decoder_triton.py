"""Triton kernels of the lean decoder's elementwise steps (decoder_ops.py has the reference).

- `add_rms_norm_kernel`: a row's residual add (in place) and RMSNorm, one program a row.
- `rope_kernel`: RoPE on every q and k head of a row, in place in the fused q/k/v product; with
  `STORE`, the row's rotated k and its v also written to its slot of a paged cache.
- `silu_mul_kernel`: SiLU(gate) * up over blocks of a row's intermediate columns.
`ROUND` rounds to the model's dtype wherever torch's separate ops do (the products and sums of
RoPE, the activation before its product, the normalized row before its scale), so a bf16 result
is torch's to the bit but for the reductions' order and exp; float32 runs without fused
multiply-adds (`enable_fp_fusion=False`), as torch's separate kernels do. `BITS` rounds to bf16
by integer ops: Triton's interpreter (the CPU tests) truncates float32 -> bf16 instead of
rounding to nearest. Imported lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh_kernels.decoder_ops import KVStore


@triton.jit
def _bf16_bits(x):
    """float32 -> the float32 value of the nearest bf16 (ties to even), by integer ops."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, ROUND: tl.constexpr, BITS: tl.constexpr):
    """x (float32) rounded to DTYPE where ROUND, kept in float32 (one return: branches on
    constexprs only)."""
    y = x
    if ROUND:
        if BITS:
            y = _bf16_bits(x)
        else:
            y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _cast(x, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """x (float32) in DTYPE, rounded to nearest."""
    if BITS:
        y = _bf16_bits(x).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def add_rms_norm_kernel(X, D, W, Y, stride_x, stride_d, stride_y, n, eps,
                        HAS_DELTA: tl.constexpr, ROUND: tl.constexpr, BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(D + row * stride_d + cols, mask=ok, other=0.0)
        x = _cast(x.to(tl.float32) + d.to(tl.float32), X.dtype.element_ty, BITS)
        tl.store(X + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    y = _rounded(xf * inv, Y.dtype.element_ty, ROUND, BITS) * w
    tl.store(Y + row * stride_y + cols, _cast(y, Y.dtype.element_ty, BITS), mask=ok)


@triton.jit
def rope_kernel(QK, COS, SIN, KC, VC, SLOTS, stride_t, stride_h, stride_ct, stride_st,
                stride_ks, stride_vs, n_heads, heads,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
                BLOCK_V: tl.constexpr, V_WIDTH: tl.constexpr, STORE: tl.constexpr,
                ROUND: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    j_ok = j < HALF
    ok = (h < n_heads)[:, None] & j_ok[None, :]
    lo = QK + t * stride_t + h[:, None] * stride_h + j[None, :]  # [BLOCK_H, BLOCK_J]
    dtype = QK.dtype.element_ty
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(COS + t * stride_ct + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(COS + t * stride_ct + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN + t * stride_st + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SIN + t * stride_st + HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    # torch: qk * cos + cat(-x2, x1) * sin, every product and the sum in the model's dtype
    y1 = _rounded(x1 * c1, dtype, ROUND, BITS) + _rounded(-x2 * s1, dtype, ROUND, BITS)
    y2 = _rounded(x2 * c2, dtype, ROUND, BITS) + _rounded(x1 * s2, dtype, ROUND, BITS)
    y1, y2 = _cast(y1, dtype, BITS), _cast(y2, dtype, BITS)
    tl.store(lo, y1, mask=ok)
    tl.store(lo + HALF, y2, mask=ok)
    if STORE:  # the row's k heads and v to its cache slot ([KVH, d] rows, contiguous)
        slot = tl.load(SLOTS + t).to(tl.int64)
        k_ok = ok & (h >= heads)[:, None]
        k_at = KC + slot * stride_ks + (h - heads)[:, None] * (2 * HALF) + j[None, :]
        tl.store(k_at, y1, mask=k_ok)
        tl.store(k_at + HALF, y2, mask=k_ok)
        c = tl.arange(0, BLOCK_V)
        v = tl.load(QK + t * stride_t + n_heads * stride_h + c, mask=c < V_WIDTH)
        tl.store(VC + slot * stride_vs + c, v, mask=c < V_WIDTH)


@triton.jit
def silu_mul_kernel(GU, OUT, stride_g, stride_o, n, ROUND: tl.constexpr, BITS: tl.constexpr,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(GU + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_g + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), OUT.dtype.element_ty, ROUND, BITS)
    tl.store(OUT + t * stride_o + cols, _cast(act * u, OUT.dtype.element_ty, BITS), mask=ok)


# ---------------------------------------------------------------------------------------------
# host side
SILU_BLOCK = 1024


def _rows(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "rows [T, width], each contiguous"
    assert x.dtype in (torch.float32, torch.bfloat16), f"float32 or bfloat16, not {x.dtype}"


def _flags(x: torch.Tensor) -> dict:
    """ROUND / BITS of a kernel over x (module docstring)."""
    bf16 = x.dtype == torch.bfloat16
    return {"ROUND": bf16, "BITS": bf16 and x.device.type == "cpu"}


class TritonOps:
    """decoder_ops.TorchOps' steps as one Triton launch each (module docstring)."""

    name = "triton"

    @staticmethod
    def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        _rows(x)
        n = int(x.shape[1])
        if delta is not None:
            _rows(delta)
            assert delta.shape == x.shape and delta.dtype == x.dtype, "delta like x"
        y = torch.empty_like(x)
        if x.shape[0]:
            add_rms_norm_kernel[(x.shape[0],)](
                x, x if delta is None else delta, weight, y, x.stride(0),
                x.stride(0) if delta is None else delta.stride(0), y.stride(0), n, eps,
                HAS_DELTA=delta is not None, **_flags(x),
                BLOCK=triton.next_power_of_2(n), enable_fp_fusion=False)
        return x, y

    @staticmethod
    def rope(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
             store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _rows(qkv)
        t, d = int(qkv.shape[0]), int(cos.shape[-1])
        width = (heads + kv_heads) * d
        assert qkv.shape[1] == width + kv_heads * d, "qkv: [T, (H + 2 KVH) d]"
        assert cos.shape == sin.shape == (t, 1, d) and cos.dtype == qkv.dtype, "cos, sin"
        if store is not None:
            k_cache, v_cache, slots = store
            for cache in (k_cache, v_cache):
                assert cache.shape[1:] == (kv_heads, d) and cache.dtype == qkv.dtype, \
                    "caches [num_slots, KVH, d] in the model's dtype"
                assert cache.stride(1) == d and cache.stride(2) == 1, "a slot's row contiguous"
            assert slots.shape == (t,) and slots.device == qkv.device, "a slot a row"
        else:
            k_cache = v_cache = slots = qkv
        if t:
            rope_kernel[(t,)](qkv, cos, sin, k_cache, v_cache, slots, qkv.stride(0), d,
                              cos.stride(0), sin.stride(0), k_cache.stride(0), v_cache.stride(0),
                              heads + kv_heads, heads, HALF=d // 2,
                              BLOCK_H=triton.next_power_of_2(heads + kv_heads),
                              BLOCK_J=triton.next_power_of_2(d // 2),
                              BLOCK_V=triton.next_power_of_2(kv_heads * d), V_WIDTH=kv_heads * d,
                              STORE=store is not None, **_flags(qkv), enable_fp_fusion=False)
        return (qkv[:, :heads * d].view(t, heads, d), qkv[:, heads * d:width].view(t, kv_heads, d),
                qkv[:, width:].view(t, kv_heads, d))

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        _rows(gate_up)
        t, n = int(gate_up.shape[0]), int(gate_up.shape[1]) // 2
        out = gate_up.new_empty(t, n)
        if t:
            block = min(SILU_BLOCK, triton.next_power_of_2(n))
            silu_mul_kernel[(t, triton.cdiv(n, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), n,
                **_flags(gate_up), BLOCK=block, enable_fp_fusion=False)
        return out
