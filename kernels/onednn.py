"""Linear layers whose weights are packed once for oneDNN (`PackedLinear`): targets and drafts.

A verify step multiplies every weight matrix by root + tree rows (1-64 per request), a shape
where torch's default CPU GEMM re-packs the whole weight on every call and its cost grows almost
linearly with the rows; in oneDNN's blocked layout the cost is nearly flat in the rows. Small
layers keep their dense matrix for one-row calls (`DENSE_ONE_ROW_MAX`). Measurements:
docs/decisions/cpu-linear-kernels.md; which layers a model gets: linear_rules.py.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

# weights; up to this, torch's one-row product beats oneDNN's per-call overhead
# (docs/decisions/cpu-linear-kernels.md)
DENSE_ONE_ROW_MAX = 1 << 20


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN; the dense W is kept only for one-row calls of small
    layers (`keep_dense`, default: weight elements <= DENSE_ONE_ROW_MAX), else dropped.

    `row_stable`: a row's bits do not depend on how many rows share the call. oneDNN's one-row
    path (a matrix-vector product) sums in another order than its multi-row kernel, whose rows
    agree bit for bit (2..64 rows measured, docs/decisions/target-weights.md): a one-row call
    runs as two rows, a zero row beside it, and the spare row is dropped. A target's layers
    need it (plain decoding runs one row, a verify step a tree's rows); a draft's do not."""

    def __init__(self, linear: nn.Linear, keep_dense: bool | None = None,
                 row_stable: bool = False):
        super().__init__()
        self.row_stable = row_stable
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # an opaque oneDNN tensor: not a parameter (no autograd, not in the state dict)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.weight_dtype = weight.dtype
        if keep_dense is None:
            keep_dense = weight.numel() <= DENSE_ONE_ROW_MAX and not row_stable
        self.register_buffer("dense", weight if keep_dense else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight_dtype:
            raise TypeError(f"PackedLinear holds {self.weight_dtype} weights, got {x.dtype} input")
        one_row = x.numel() == self.in_features
        if one_row and self.dense is not None:  # matrix-vector
            return nn.functional.linear(x, self.dense, self.bias)
        if one_row and self.row_stable:  # as two rows, the spare one dropped
            two = torch.cat([x.reshape(1, self.in_features), x.new_zeros(1, self.in_features)])
            return self.forward(two)[:1].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.weight_dtype} (oneDNN packed"
                f"{', dense for one row' if self.dense is not None else ''}"
                f"{', one-row calls as two' if self.row_stable else ''})")


@functools.cache
def onednn_supports(dtype: torch.dtype) -> str | None:
    """None when oneDNN can pack and run a linear of `dtype` on this CPU, else the reason
    (probed once per dtype: every Int4Linear of a model asks)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    try:
        probe = nn.Linear(16, 8).to(dtype)
        with torch.inference_mode():
            PackedLinear(probe)(torch.ones(2, 16, dtype=dtype))
    except (RuntimeError, TypeError) as exc:  # e.g. bf16 without AVX512-BF16
        return str(exc).splitlines()[0]
    return None
