"""Linear layers for small row counts on CPU: weights packed once for oneDNN.

Why: a verify step multiplies every weight matrix by root + tree rows (1-64 per request), a shape
where torch's default CPU GEMM (MKL sgemm) re-packs the whole weight matrix on every call. On an
AMD EPYC with AVX2 (where these figures were measured) MKL's cost grows almost linearly with the rows: Qwen2.5-1.5B's
MLP up-projection (8960 x 1536, float32) takes 3.7 ms for 1 row, 22 ms for 8 and 31 ms for 32,
so verifying 8 tokens cost ~4x a plain step and speculation could not pay. oneDNN with the weight
reordered once into its blocked layout (what torch.compile's CPU weight freezing does) reads the
weights once per call: 3.4 / 5.3 / 14 ms for the same shapes. `python -m bench.linear` measures
a whole model's step (Qwen2.5-1.5B fp32, 300 cached tokens: 8 rows 4.6x one row with torch's
linear, 1.67x packed).

oneDNN costs ~0.1 ms more per call than torch's single-row product (a matrix-vector product), which
outweighs the bandwidth it saves on small matrices: SmolLM2-135M's one-row step took 151 ms packed
vs 131 ms with torch's. Layers of at most `DENSE_ONE_ROW_MAX` weights therefore keep their dense
matrix too and run one-row calls through torch (double memory for those layers only: SmolLM2's
hidden layers, the attention projections of the Qwen models; their MLPs and LM heads are larger).

bfloat16: oneDNN packs bf16 weights only on CPUs with AVX512-BF16/AVX-NE-CONVERT; elsewhere
(`auto`) bf16 models keep torch's linear, whose cost grows linearly with the rows on such CPUs.
On CPUs with AVX512-BF16 / AMX (an Intel Xeon in this project's 2026-11-23 runs) `auto` packs bf16.

    pack_linears(model, "auto")   # every nn.Linear -> PackedLinear where oneDNN takes its dtype
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("auto", "torch", "onednn")  # config.Settings.linear
DENSE_ONE_ROW_MAX = 1 << 20  # weights; see the module docstring


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN; the dense W is kept only for one-row calls of small
    layers (`keep_dense`, default: weight elements <= DENSE_ONE_ROW_MAX), else dropped."""

    def __init__(self, linear: nn.Linear, keep_dense: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # an opaque oneDNN tensor: not a parameter (no autograd, not in the state dict)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.weight_dtype = weight.dtype
        if keep_dense is None:
            keep_dense = weight.numel() <= DENSE_ONE_ROW_MAX
        self.register_buffer("dense", weight if keep_dense else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight_dtype:
            raise TypeError(f"PackedLinear holds {self.weight_dtype} weights, got {x.dtype} input")
        if self.dense is not None and x.numel() == self.in_features:  # one row: matrix-vector
            return nn.functional.linear(x, self.dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.weight_dtype} (oneDNN packed"
                f"{', dense for one row' if self.dense is not None else ''})")


def onednn_supports(dtype: torch.dtype) -> str | None:
    """None when oneDNN can pack and run a linear of `dtype` on this CPU, else the reason."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    try:
        probe = nn.Linear(16, 8).to(dtype)
        with torch.inference_mode():
            PackedLinear(probe)(torch.ones(2, 16, dtype=dtype))
    except (RuntimeError, TypeError) as exc:  # e.g. bf16 without AVX512-BF16
        return str(exc).splitlines()[0]
    return None


def pack_linears(model: nn.Module, backend: str = "auto") -> int:
    """Replaces every CPU nn.Linear of `model` by a PackedLinear; returns how many were replaced.

    backend: "torch" keeps torch's linear; "onednn" packs or raises where oneDNN cannot run the
    model's dtype; "auto" packs where it can (CPU, oneDNN takes the dtype) and keeps torch's
    linear elsewhere. Tied weights (a LM head sharing the embedding matrix) are packed as a copy:
    the embedding keeps its dense matrix for lookups.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend '{backend}' (expected one of {BACKENDS})")
    if backend == "torch":
        return 0
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears:
        return 0
    weight = linears[0][1].weight
    reason = None if weight.device.type == "cpu" else f"weights on {weight.device.type}"
    reason = reason or onednn_supports(weight.dtype)
    if reason is not None:
        if backend == "onednn":
            raise RuntimeError(f"linear backend 'onednn' cannot run {weight.dtype}: {reason}")
        log.info("linear layers: torch (%s)", reason)
        return 0
    with torch.inference_mode(False), torch.no_grad():
        for name, module in linears:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, PackedLinear(module))
    log.info("linear layers: %d packed for oneDNN (%s)", len(linears), weight.dtype)
    return len(linears)
