"""Linear layers with 4-bit weights through torch's CPU int4 kernel (`Int4Linear`).

A draft rounds its weights to 4-bit groups (`round_int4`; docs/decisions/draft-quantization.md).
A native target runs the layers its GGUF stored as 4-bit blocks with the blocks' own codes,
which `int4_lattice` recovers from the dequantized weights: the served numbers are the stored
ones, and a row's result does not depend on the rows beside it in a call; its prompt rows may
go through a bf16 copy (`Int4Linear.prefill`; docs/decisions/target-weights.md). Conversion of
a model: linear_rules.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from specmesh_kernels.cpu_probe import probe
from specmesh_kernels.fp16 import Fp16Linear, fp16_supports, fp16_weight_error
from specmesh_kernels.onednn import PackedLinear, onednn_supports

INT4_GROUP = 32  # inputs per (scale, offset) pair of Int4Linear
# calls with at least this many rows (a prompt's prefill) use Int4Linear's bf16 copy (docstring)
INT4_DENSE_ROWS = 16
# how far off a level a weight may be, in levels, and still count as that level: float32
# dequantization errs by ~1e-6 of one, a value off the lattice by far more
LATTICE_TOLERANCE = 1e-3
# weights per pass of `int4_lattice`: under torch's parallel grain (32768), so every op runs
# cache-resident on the calling thread; a thread team per op cost 10-50x more on a busy 2-core
# host (docs/decisions/target-weights.md)
LATTICE_CHUNK = 32000
ROUNDING = 1.5 * 2 ** 23  # float32's integers are 1 apart from 2^23


class Int4Codes(NamedTuple):
    """A weight [out, in] as 4-bit groups: w = low + codes * step per row and group of inputs."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    low: torch.Tensor  # [out, in // group] float32: each group's smallest weight
    step: torch.Tensor  # [out, in // group] float32: its level spacing (0: a constant group)


def round_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> Int4Codes:
    """`weight` [out, in] rounded to 16 evenly spaced levels from each group's minimum to its
    maximum (a draft's quantization: not exact)."""
    groups = weight.reshape(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low) / step).round().clamp(0, 15).to(torch.uint8)
    return Int4Codes(codes.view_as(weight), low[..., 0], step[..., 0])


def int4_lattice(weight: torch.Tensor, group_size: int = INT4_GROUP) -> Int4Codes | None:
    """The exact 4-bit codes of `weight` [out, in] when every group of `group_size` inputs lies
    on a lattice low + q * step with integers q in 0..15, else None: what a GGUF 4-bit block
    dequantizes to, Q4_0 / Q4_1 (q spans 0..15) and Q4_K (d*sc*q - dmin*m: the quantizer often
    leaves q short of 0 or 15, so min and max alone do not give the step).

    A group with range r is on a lattice when (w - min) * k / r is an integer for every w, for
    some k in 1..15 (k = max code); k = 15 is tried first (most groups), 14..1 for the rest.
    Vectorized over chunks of LATTICE_CHUNK weights: ~3.5 ns of one core per weight, 4-8 s for
    the 1.1e9 4-bit weights of a 1.5B model; a layer that is not 4-bit fails in its first chunk."""
    if weight.dim() != 2 or weight.shape[1] % group_size:
        return None
    groups = weight.detach().reshape(-1, group_size).float()
    count, chunk = groups.shape[0], max(1, LATTICE_CHUNK // group_size)
    codes = torch.empty(count, group_size, dtype=torch.uint8)
    low, step = torch.empty(count, 1), torch.empty(count, 1)
    scratch = torch.empty(4, min(count, chunk), group_size)
    for start in range(0, count, chunk):
        end = min(start + chunk, count)
        if not _lattice_chunk(groups[start:end], scratch[:, :end - start], codes[start:end],
                              low[start:end], step[start:end]):
            return None
    out, features = weight.shape
    return Int4Codes(codes.view(out, features), low.view(out, -1), step.view(out, -1))


def _lattice_chunk(groups: torch.Tensor, scratch: torch.Tensor, codes: torch.Tensor,
                   low: torch.Tensor, step: torch.Tensor) -> bool:
    """`int4_lattice` of `groups` [n, group] into codes [n, group], low / step [n, 1] (scratch:
    [4, n, group] float32); False when some group is on no lattice. Every pass covers the whole
    chunk (masked by `pending`): gathering the few groups left costs more than the passes."""
    torch.amin(groups, -1, keepdim=True, out=low)
    span = groups.amax(-1, keepdim=True).sub_(low).clamp_(min=1e-30)  # constant: codes 0
    unit = torch.sub(groups, low, out=scratch[0]).mul_(span.reciprocal())  # 0..1
    found = scratch[1]
    levels = torch.full_like(span, 15.0)
    pending = None  # groups not yet on a lattice
    for k in range(15, 0, -1):
        x = torch.mul(unit, k, out=scratch[2])
        # round to nearest by adding 1.5 * 2^23 (torch.round and floor start a thread team
        # however small the tensor; x is within 0..15)
        rounded = torch.add(x, ROUNDING, out=scratch[3]).sub_(ROUNDING)
        # `<=` is False for nan: a nan weight is on no lattice
        fit = x.sub_(rounded).abs_().amax(-1, keepdim=True) <= LATTICE_TOLERANCE
        if pending is None:
            found.copy_(rounded)
            pending = ~fit
        else:
            fit &= pending
            torch.where(fit, rounded, found, out=found)
            levels.masked_fill_(fit, k)
            pending &= ~fit
        if not pending.any():
            codes.copy_(found)
            torch.div(span, levels, out=step)
            return True
    return False


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit codes q (0..15), one scale s and offset z per row and group
    of `group_size` inputs: W ~ (q - 8) * s + z, s and z held in bf16. `codes=None` rounds W to
    nearest (asymmetric: the group's minimum and maximum are exact codes); given `codes`
    (`int4_lattice`: a GGUF 4-bit layer) are kept as they are. Packed once for torch's CPU int4
    kernel, which takes bf16 activations; float32 input and output (the rest of the draft stays
    float32: CPU attention in bf16 is several times slower for one row). Rows are padded to a
    multiple of 16 (the kernel's tile) and the padding sliced off.

    The int4 kernel is built for few rows and prefills ~3x slower than bf16 weights packed for
    oneDNN, while a draft's prefill is on the request's critical path
    (docs/decisions/draft-quantization.md). The layer therefore also keeps its weights rounded
    to bf16 for calls of `dense_rows` rows or more (default INT4_DENSE_ROWS): packed for oneDNN
    where it runs bf16, else as an Fp16Linear (AVX2 CPUs); more memory (2 bytes per weight
    besides the 4-bit codes), the prefill at the speed of those kernels. A draft's guesses need
    not be exact, so its prompt rows may come from bf16 weights and its drafted ones from int4.
    `dense_rows=None`: int4 for every call; `prefill_dense` then still keeps the bf16 copy for
    `prefill` calls (a native target's prompt rows, module docstring)."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP,
                 dense_rows: int | None = INT4_DENSE_ROWS, codes: Int4Codes | None = None,
                 prefill_dense: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % group_size:
            raise TypeError(f"int4 needs in_features divisible by {group_size}, got "
                            f"{self.in_features}")
        if codes is None:  # round to nearest: the group's minimum and maximum are exact codes
            codes = round_int4(linear.weight.detach().float(), group_size)
        elif codes.codes.shape != (self.out_features, self.in_features) or \
                codes.low.shape != (self.out_features, self.in_features // group_size):
            raise ValueError(f"codes of shape {tuple(codes.codes.shape)} in groups of "
                             f"{codes.codes.shape[1] // codes.low.shape[1]} do not fit a "
                             f"{self.out_features} x {self.in_features} layer in groups of "
                             f"{group_size}")
        pad = -self.out_features % 16  # the kernel's tile; padding rows are sliced off
        q, low, step = (nn.functional.pad(t, (0, 0, 0, pad)) for t in codes)
        offset = low + 8 * step  # (q - 8) * s + z == q * s + low
        # [groups, rows, 2] bf16: the kernel's layout of (scale, offset)
        self.register_buffer("scales", torch.stack([step, offset], -1).transpose(0, 1)
                             .contiguous().bfloat16(), persistent=False)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1), persistent=False)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.group_size = group_size
        self.dense = None  # a bf16 or fp16 copy for calls of >= dense_rows rows
        if dense_rows is not None or prefill_dense:
            copy = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=False,
                                      dtype=torch.bfloat16)  # skip_init: no random init to undo
            copy.weight.data = linear.weight.detach().to(torch.bfloat16)
            if onednn_supports(torch.bfloat16) is None:
                self.dense = PackedLinear(copy, keep_dense=False)
            elif fp16_supports() is None and fp16_weight_error(copy.weight) is None:
                self.dense = Fp16Linear(copy)  # CPUs without bf16 arithmetic (AVX2)
        self.dense_rows = dense_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.dense_rows)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows: through the dense copy where the layer keeps one (many rows at the
        speed of the dense kernels), else as `forward`."""
        return self._product(x, 0)

    def _product(self, x: torch.Tensor, dense_rows: int | None) -> torch.Tensor:
        """Through the dense copy from `dense_rows` rows on (None: never), else int4."""
        if x.dtype != torch.float32:
            raise TypeError(f"Int4Linear takes float32 input, got {x.dtype}")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.dense is not None and dense_rows is not None and flat.shape[0] >= dense_rows:
            y = self.dense(flat)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                            self.scales)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features]
        # bf16 + float32 bias promotes to float32: one operation (a draft's layers are many)
        y = y.float() if self.bias is None else torch.add(self.bias, y)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dense = ""
        if self.dense is not None:
            kind = "bf16" if isinstance(self.dense, PackedLinear) else "fp16"
            dense = (f", {kind} for >= {self.dense_rows} rows" if self.dense_rows is not None
                     else f", {kind} for prefill")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int4 in groups of {self.group_size}{dense}")


def int4_supports() -> str | None:
    """None when torch's CPU int4 kernel runs here, else the reason."""
    return probe(Int4Linear, 64)


def exact_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> bool:
    """Whether every group of `group_size` inputs of `weight` [out, in] holds 4-bit lattice
    values (`int4_lattice`): a GGUF 4-bit layer, served by Int4Linear with its codes unchanged."""
    return int4_lattice(weight, group_size) is not None
