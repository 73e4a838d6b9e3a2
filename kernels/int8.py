"""Draft linear layers with int8 weights through FBGEMM's dynamic int8 GEMM (`Int8Linear`).

A draft only guesses (the target verifies every token, so the served output does not change)
and at batch 1 its time is the bytes of its weights. Without VNNI the weights take 7-bit codes
(`narrow`; docs/decisions/draft-quantization.md). A draft's layers are converted by
linear_rules.quantize_linears.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from specmesh_kernels.cpu_probe import cpu_has, probe


class Int8Linear(nn.Module):
    """y = x W^T + b with W quantized to int8 once (symmetric, one scale per output row) and
    prepacked for FBGEMM; x is quantized per call (dynamic, per tensor, unsigned 8 bits) and
    the product is accumulated in int32 (torch's `quantized::linear_dynamic`). Float32 input
    and output.

    Without VNNI (AVX2, AVX512 without VNNI) FBGEMM multiplies through `vpmaddubsw`, which adds
    pairs of u8 x s8 products in int16 and saturates: 2 * 255 * 127 overflows 32767, and
    full-range int8 gives garbage there. FBGEMM's own remedy, `reduce_range`, halves the
    activations' range (7 bits), and one outlier channel of a row then costs every other channel
    half its resolution. `narrow` halves the weights' range instead: codes in [-63, 63], one
    scale per row, so a pair stays within 2 * 255 * 63 = 32130 and the activations keep 8 bits:
    about half reduce_range's error and better draft agreement
    (docs/decisions/draft-quantization.md). `narrow=None`: narrow on CPUs without VNNI."""

    def __init__(self, linear: nn.Linear, narrow: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if narrow is None:
            narrow = not cpu_has("avx512_vnni", "avx_vnni")
        self.narrow = narrow
        weight = linear.weight.detach().float()
        levels = 63 if narrow else 127
        scale = (weight.abs().amax(dim=1).clamp(min=1e-12) / levels).double()
        with warnings.catch_warnings():
            # deprecated in torch, still its fastest int8 linear on x86 (docs/decisions/
            # draft-quantization.md). Should a torch drop it, `int8_supports` says so.
            warnings.filterwarnings("ignore", message=".*quantize_per_.*deprecated")
            qweight = torch.quantize_per_channel(
                weight, scale, torch.zeros(self.out_features, dtype=torch.long), 0,
                torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        # an opaque FBGEMM object: not a parameter, not in the state dict
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.has_bias = bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"Int8Linear takes float32 input, got {x.dtype}")
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, weight=int8 per row (FBGEMM, dynamic activations"
                f"{', 7-bit weight codes' if self.narrow else ''})")


def int8_supports() -> str | None:
    """None when FBGEMM's dynamic int8 linear runs here, else the reason."""
    return probe(Int8Linear, 16, "x86 int8 kernels")
