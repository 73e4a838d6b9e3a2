"""A native target's linear layers that are not 4-bit (`RowStableLinear`): float32 or bf16
weights, float32 in and out, and every row's result independent of the rows beside it in a call
(oneDNN's one-row calls run as two, FBGEMM's fp16 calls padded to a stable block).
Why: docs/decisions/target-weights.md.
"""
from __future__ import annotations

import torch
from torch import nn

from specmesh_kernels.fp16 import Fp16Linear, fp16_row_blocks, fp16_supports
from specmesh_kernels.onednn import PackedLinear, onednn_supports


class RowStableLinear(nn.Module):
    """y = x W^T + b with W in `dtype`, float32 input and output: a target's layers that are
    not 4-bit. float32 keeps the weights as stored; bfloat16 reads half the bytes (inputs and
    product rounded to bf16, the bias added in float32).

    A target layer must give a row the same bits whatever rows share its call (plain decoding
    runs one row, a verify step a tree's rows): packed `row_stable` for oneDNN (PackedLinear),
    or, for bf16 on CPUs where oneDNN has no bf16 (AVX2), FBGEMM's fp16-weight GEMM with its
    rows padded to a stable block (Fp16Linear: the bf16 weights are float16 values, the bf16
    inputs' products exact in float32, as in oneDNN's bf16 product up to the order of the sum)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        copy = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=False,
                                  dtype=dtype)
        copy.weight.data = linear.weight.detach().to(dtype)
        if dtype == torch.bfloat16 and onednn_supports(dtype) is not None:
            self.packed = Fp16Linear(copy, row_stable=True)
        else:
            self.packed = PackedLinear(copy, keep_dense=False, row_stable=True)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.weight_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"RowStableLinear takes float32 input, got {x.dtype}")
        y = self.packed(x.reshape(-1, self.in_features).to(self.weight_dtype))
        y = y.float() if self.bias is None else torch.add(self.bias, y)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = ("FBGEMM float16, rows padded" if isinstance(self.packed, Fp16Linear)
               else "oneDNN packed, one-row calls as two")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.weight_dtype} ({how})")


def row_stable_supports(dtype: torch.dtype) -> str | None:
    """None when RowStableLinear runs `dtype` weights here, else the reason."""
    reason = onednn_supports(dtype)
    if reason is None or dtype != torch.bfloat16:
        return reason
    if fp16_supports() is not None or fp16_row_blocks() is None:
        return f"{reason}; fp16: {fp16_supports() or 'rows depend on the call size'}"
    return None
