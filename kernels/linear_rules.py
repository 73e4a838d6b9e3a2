"""Which linear layer a model's weights become, per CPU, dtype and role:

    pack_linears(model, "auto")             # nn.Linear -> PackedLinear, or Fp16Linear for bf16
    quantize_linears(draft_model, "int4")   # a draft's nn.Linear -> Int4Linear (or Int8Linear)
    native_int4(target_model)               # GGUF 4-bit layers -> Int4Linear, the rest row-stable

Draft models may run with int8 or int4 weights: int4 on AVX512 CPUs, int8 elsewhere
(`draft_weights`, a spec's `@auto`; docs/decisions/draft-quantization.md). A target is never
re-quantized: the target's own numbers are what the output must equal. Kernels by CPU:
docs/decisions/cpu-linear-kernels.md; native targets: docs/decisions/target-weights.md.
"""
from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from specmesh_kernels.fp16 import Fp16Linear, fp16_row_blocks, fp16_supports, fp16_weight_error
from specmesh_kernels.int4 import INT4_GROUP, Int4Linear, int4_lattice, int4_supports
from specmesh_kernels.int8 import Int8Linear, int8_supports
from specmesh_kernels.onednn import PackedLinear, onednn_supports
from specmesh_kernels.row_stable import RowStableLinear, row_stable_supports

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("auto", "torch", "onednn", "fp16")  # config.Settings.linear


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
