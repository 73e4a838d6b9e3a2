"""bf16 linear layers on CPUs without bf16 arithmetic (AVX2): float16 weights through FBGEMM's
fp16-weight GEMM (`Fp16Linear`, float32 products: exact for bf16 weights in float16's range).
`fp16_row_blocks` pads a call's rows so that a row's bits do not depend on the rows beside it,
as a target needs. Why and measurements: docs/decisions/cpu-linear-kernels.md,
docs/decisions/target-weights.md.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from specmesh_kernels.cpu_probe import probe


class Fp16Linear(nn.Module):
    """y = x W^T + b for bf16 weights on CPUs without bf16 arithmetic: W is stored
    as float16 and multiplied by FBGEMM's fp16-weight GEMM (`quantized::linear_dynamic_fp16`),
    which converts weight tiles to float32 in registers (F16C) and accumulates in float32.
    The input is taken in its own dtype, multiplied in float32, and returned in that dtype.

    Why: on AVX2-only CPUs torch's bf16 linear is a matrix-vector product per row, so its cost
    grows linearly with the rows; FBGEMM's stays nearly flat (docs/decisions/cpu-linear-kernels.md).

    Numbers: a bf16 value whose exponent lies in float16's normal range (|w| in [2^-14, 65504])
    is exactly a float16 (bf16 has 7 mantissa bits, float16 10), and bf16 x bf16 products are
    exact in float32, so the layer computes what torch's bf16 linear computes (float32
    accumulation of exact products, rounded once to bf16 by the caller's dtype) up to the order
    of the sum. Weights below 2^-14 become float16 subnormals, rounded to a multiple of 2^-24
    (an absolute error below 6e-8, far under the bf16 rounding of the output); weights beyond
    float16's range raise (`fp16_weight_error` says so before a model is converted)."""

    def __init__(self, linear: nn.Linear, checked: bool = False, row_stable: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        reason = None if checked else fp16_weight_error(weight)  # checked: by the caller
        if reason is not None:
            raise ValueError(reason)
        self.pad: tuple[int, ...] | None = None
        if row_stable:
            blocks = fp16_row_blocks()
            if blocks is None:
                raise RuntimeError("FBGEMM's fp16 rows depend on the call's rows on this CPU")
            self.pad = blocks
        self.weight_dtype = weight.dtype
        bias = linear.bias.detach().float() if linear.bias is not None else None
        # an opaque FBGEMM object: not a parameter, not in the state dict
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), bias)
        self.has_bias = bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        rows = flat.shape[0]
        extra = self.pad[rows % len(self.pad)] if self.pad is not None else 0
        if extra:  # zero rows after the last block's, dropped below (`fp16_row_blocks`)
            flat = torch.cat([flat, flat.new_zeros(extra, self.in_features)])
        y = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)
        if extra:
            y = y[:rows]
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, weight={self.weight_dtype} as float16 (FBGEMM, float32 "
                f"products{', rows padded to a stable block' if self.pad is not None else ''})")


FP16_BLOCK_CANDIDATES = (6, 14)  # FBGEMM's fp16 row blocks: 6 on AVX2, 14 on AVX512


@functools.cache
def fp16_row_blocks() -> tuple[int, ...] | None:
    """Zero rows to add to a call of n rows so that FBGEMM's fp16 GEMM gives every row the bits
    it gets in any other call: `pad[n % block]`. FBGEMM runs the rows in blocks of `block` and a
    last block of r rows through an r-row kernel; some of those (1 and 2 rows on AVX2) sum in
    another order than the full block (docs/decisions/target-weights.md). Probed once on a small
    layer: per remainder, the fewest extra rows that give the full block's bits; None where no
    candidate block passes (the caller then keeps oneDNN float32)."""
    if fp16_supports() is not None:
        return None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen).bfloat16().float()
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    for block in FP16_BLOCK_CANDIDATES:
        x = torch.randn(5 * block, 256, generator=gen)
        ref = torch.ops.quantized.linear_dynamic_fp16(x, packed)  # full blocks only

        def rows(n: int, extra: int) -> torch.Tensor:
            padded = torch.cat([x[:n], x.new_zeros(extra, 256)]) if extra else x[:n]
            return torch.ops.quantized.linear_dynamic_fp16(padded, packed)[:n]

        good = [r for r in range(1, block) if torch.equal(rows(r, 0), ref[:r])]
        pad = tuple(0 if r == 0 else min([g for g in good if g >= r] + [block]) - r
                    for r in range(block))
        if all(torch.equal(rows(n, pad[n % block]), ref[:n]) for n in range(1, 3 * block + 3)):
            return pad
    return None


FP16_MAX = 65504.0


def fp16_weight_error(weight: torch.Tensor) -> str | None:
    """None when every weight fits float16's range (Fp16Linear's docstring), else why not."""
    largest = weight.abs().amax().item() if weight.numel() else 0.0  # nan and inf propagate
    if not math.isfinite(largest):
        return "weights hold inf or nan"
    if largest > FP16_MAX:
        return f"a weight of magnitude {largest:g} exceeds float16's range ({FP16_MAX:g})"
    return None


@functools.cache
def fp16_supports() -> str | None:
    """None when FBGEMM's fp16-weight linear runs here, else the reason (probed once)."""
    return probe(Fp16Linear, 16, "x86 fp16-weight kernels")
