"""Linear layers for small row counts on CPU: weights packed once for oneDNN, and quantized
weights for draft models and native (GGUF 4-bit) targets.

A verify step multiplies every weight matrix by root + tree rows (1-64 per request), a shape
where torch's default CPU GEMM re-packs the whole weight on every call and its cost grows almost
linearly with the rows. `pack_linears` replaces a model's nn.Linear layers by `PackedLinear`
(weights reordered once into oneDNN's blocked layout: cost nearly flat in the rows) or, for bf16
models on CPUs without bf16 arithmetic, `Fp16Linear` (FBGEMM's fp16-weight GEMM); small layers
keep their dense matrix for one-row calls (`DENSE_ONE_ROW_MAX`). Measurements:
docs/decisions/cpu-linear-kernels.md.

    pack_linears(model, "auto")   # every nn.Linear -> PackedLinear where oneDNN takes its dtype

Draft models may also run with int8 (`Int8Linear`) or int4 (`Int4Linear`) weights: a draft only
guesses (the target verifies every token, so the served output does not change) and at batch 1
its time is the bytes of its weights. int4 on AVX512 CPUs, int8 elsewhere (`draft_weights`, a
spec's `@auto`): faster drafting per token (docs/decisions/draft-quantization.md). A target is
never re-quantized: the target's own numbers are what the output must equal.

    quantize_linears(draft_model)           # every nn.Linear -> Int8Linear (float32 activations)
    quantize_linears(draft_model, "int4")   # 4-bit codes in groups of 32 (torch's CPU int4 kernel)

A native target runs the layers its GGUF stored as 4-bit blocks through the same int4 kernel
with the blocks' own codes (`int4_lattice` recovers them from the dequantized weights) and its
other layers as `RowStableLinear` (bf16 oneDNN); every row's result is independent of the rows
beside it in a call (docs/decisions/target-weights.md).

    native_int4(target_model)               # Q4_0 / Q4_1 / Q4_K layers -> Int4Linear, rest bf16
"""
from __future__ import annotations

import functools
import logging
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("auto", "torch", "onednn", "fp16")  # config.Settings.linear
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


def probe(layer, features: int, fbgemm: str | None = None) -> str | None:
    """None when `layer(nn.Linear(features, 16))` runs a product here, else the reason; `fbgemm`
    names the kernels when the layer needs torch's FBGEMM (x86 only)."""
    if fbgemm and "fbgemm" not in torch.backends.quantized.supported_engines:
        return f"torch was built without FBGEMM ({fbgemm})"
    try:
        with torch.inference_mode():
            layer(nn.Linear(features, 16))(torch.ones(2, features))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0] or type(exc).__name__
    return None


@functools.cache
def fp16_supports() -> str | None:
    """None when FBGEMM's fp16-weight linear runs here, else the reason (probed once)."""
    return probe(Fp16Linear, 16, "x86 fp16-weight kernels")


def pack_linears(model: nn.Module, backend: str = "auto", row_stable: bool = False) -> int:
    """Replaces every CPU nn.Linear of `model` by a PackedLinear (oneDNN) or an Fp16Linear
    (FBGEMM, bf16 weights); returns how many were replaced.

    backend: "torch" keeps torch's linear; "onednn" packs or raises where oneDNN cannot run the
    model's dtype; "fp16" converts a bf16 model's layers to Fp16Linear or raises; "auto" packs
    for oneDNN where it takes the dtype, else converts a bf16 model to Fp16Linear where FBGEMM
    runs here (CPUs without bf16 arithmetic: AVX2), and keeps torch's linear elsewhere. Tied
    weights (a LM head sharing the embedding matrix) are packed as a copy: the embedding keeps
    its dense matrix for lookups.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend '{backend}' (expected one of {BACKENDS})")
    if backend == "torch":
        return 0
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears:
        return 0
    weight = linears[0][1].weight
    dtype = weight.dtype

    def fp16_reason() -> str | None:
        if dtype != torch.bfloat16:
            return f"fp16 holds bf16 weights, the model is {dtype}"
        if row_stable and fp16_supports() is None and fp16_row_blocks() is None:
            return "FBGEMM's fp16 rows depend on the call's rows here"
        return fp16_supports() or next((f"{name}: {why}" for name, m in linears
                                        if (why := fp16_weight_error(m.weight)) is not None),
                                       None)

    if weight.device.type != "cpu":
        layer, reason = PackedLinear, f"weights on {weight.device.type}"
    elif backend == "fp16":
        layer, reason = Fp16Linear, fp16_reason()
    else:  # onednn, or auto: oneDNN where it runs the dtype, else FBGEMM's fp16 for bf16
        layer, reason = PackedLinear, onednn_supports(dtype)
        if reason is not None and backend == "auto" and dtype == torch.bfloat16:
            why = fp16_reason()
            layer, reason = (Fp16Linear, None) if why is None else (layer, f"{reason}; fp16: {why}")
    if reason is not None:
        if backend != "auto":
            raise RuntimeError(f"linear backend '{backend}' cannot run {dtype}: {reason}")
        log.info("linear layers: torch (%s)", reason)
        return 0
    how = "packed for oneDNN" if layer is PackedLinear else "float16 for FBGEMM"

    def build(module: nn.Linear) -> nn.Module:
        with torch.inference_mode(False), torch.no_grad():
            # Fp16Linear's weights were checked above
            return layer(module, row_stable=row_stable) if layer is PackedLinear \
                else layer(module, True, row_stable=row_stable)

    # FBGEMM packs on one core and releases the GIL: a 1.5B model's 198 layers took 15 s in
    # turn; packed side by side on every core
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        built = list(pool.map(build, [module for _, module in linears]))
    for (name, _), new in zip(linears, built):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    log.info("linear layers: %d %s (%s)", len(linears), how, dtype)
    return len(linears)


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


@functools.cache
def draft_weights() -> str | None:
    """The quantized weights a draft model runs fastest with on this CPU (a draft spec's
    `@auto`): int4 where torch dispatches its AVX512 kernels, int8 elsewhere, None (float
    weights) where neither runs.

    torch's CPU int4 GEMM kernel is vectorized for AVX512 only; on AVX2 its generic loop makes
    int4 drafting ~1.7x slower than int8, more than its better guesses repay
    (docs/decisions/draft-quantization.md). Probed once per process."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512") and int4_supports() is None:
        return "int4"
    if int8_supports() is None:
        return "int8"
    return "int4" if int4_supports() is None else None


QUANTIZED = {"int8": (Int8Linear, int8_supports, "FBGEMM, dynamic activations"),
             "int4": (Int4Linear, int4_supports, f"groups of {INT4_GROUP}, bf16 activations")}


def quantize_linears(model: nn.Module, weights: str = "int8", **options: Any) -> int:
    """Replaces every nn.Linear / PackedLinear of a float32 CPU model by an Int8Linear or an
    Int4Linear (`weights`; the LM head too: a tied one is quantized as a copy, the embedding
    keeps its float matrix); returns how many were replaced. `options` go to every layer's
    constructor (`dense_rows=None`: int4 for every call). For draft models only (module
    docstring)."""
    if weights not in QUANTIZED:
        raise ValueError(f"unknown weights '{weights}' (expected one of {tuple(QUANTIZED)})")
    layer, supports, how = QUANTIZED[weights]
    reason = supports()
    if reason is not None:
        raise RuntimeError(f"{weights} draft weights cannot run here: {reason}")
    linears = [(name, m) for name, m in model.named_modules()
               if type(m) in (nn.Linear, PackedLinear)]
    if not linears:
        return 0
    with torch.inference_mode(False), torch.no_grad():
        for name, module in linears:
            if isinstance(module, PackedLinear):
                raise TypeError(f"{name}: quantize a model loaded with torch's linears "
                                 f"(linear='torch'), not packed ones")
            if module.weight.dtype != torch.float32 or module.weight.device.type != "cpu":
                raise TypeError(f"{name}: {weights} needs a float32 CPU model, got "
                                f"{module.weight.dtype} on {module.weight.device.type}")
        # every layer quantized before any is swapped: an error leaves the model as it was
        swaps = [(name, layer(module, **options)) for name, module in linears]
        for name, quantized in swaps:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, quantized)
    log.info("linear layers: %d quantized to %s (%s)", len(linears), weights, how)
    return len(linears)


def cpu_has(*flags: str) -> bool:
    """Whether this (Linux) CPU reports any of `flags` in /proc/cpuinfo; False where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return any(flag in words for flag in flags)


def exact_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> bool:
    """Whether every group of `group_size` inputs of `weight` [out, in] holds 4-bit lattice
    values (`int4_lattice`): a GGUF 4-bit layer, served by Int4Linear with its codes unchanged."""
    return int4_lattice(weight, group_size) is not None


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


def native_rest() -> torch.dtype:
    """How a native target holds its layers that are not 4-bit: bf16 where oneDNN or FBGEMM's
    fp16 GEMM runs it row-stably (half the bytes of float32; docs/decisions/target-weights.md),
    else float32."""
    return torch.bfloat16 if row_stable_supports(torch.bfloat16) is None else torch.float32


def native_supports() -> str | None:
    """None when a native target runs here (the int4 kernel, oneDNN or FBGEMM for its other
    layers), else the reason."""
    return int4_supports() or row_stable_supports(native_rest())


def native_int4(model: nn.Module, rest: torch.dtype | None = None,
                prefill_dense: bool = True) -> tuple[int, int]:
    """Serves a float32 CPU model's linear layers in the 4-bit form they were stored in: every
    nn.Linear whose weights are 4-bit lattice groups (`int4_lattice`) becomes an Int4Linear with
    those codes that runs every call through the int4 kernel; the others (GGUF Q6_K, Q8_0...)
    become RowStableLinear layers holding `rest` weights (None: `native_rest()`). Both give a
    row the same result whatever the call's rows, as a target needs. `prefill_dense`: the int4
    layers also keep a bf16 copy for prompt rows (`Int4Linear.prefill`; the lean forward uses
    it). Returns (int4 layers, other layers)."""
    rest = native_rest() if rest is None else rest
    reason = int4_supports() or row_stable_supports(rest)
    if reason is not None:
        raise RuntimeError(f"native weights cannot run here: {reason}")
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if any(m.weight.dtype != torch.float32 or m.weight.device.type != "cpu" for _, m in linears):
        raise TypeError("native weights need a float32 CPU model")
    int4 = 0
    with torch.inference_mode(False), torch.no_grad():
        for name, module in linears:
            codes = int4_lattice(module.weight)
            if codes is not None:
                int4 += 1
                layer = Int4Linear(module, dense_rows=None, codes=codes,
                                   prefill_dense=prefill_dense)
            else:
                layer = RowStableLinear(module, rest)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, layer)
    log.info("native weights: %d linear layers int4 (4-bit groups of %d), %d %s",
             int4, INT4_GROUP, len(linears) - int4, str(rest).removeprefix("torch."))
    return int4, len(linears) - int4
