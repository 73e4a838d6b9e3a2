"""What this CPU runs, for choosing its linear kernels: `cpu_has` reads the flags of
/proc/cpuinfo, `probe` tries one product through a layer kind. The layers' own probes
(fp16.py, int8.py, int4.py) build on it; linear_rules.py combines them."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


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


def cpu_has(*flags: str) -> bool:
    """Whether this (Linux) CPU reports any of `flags` in /proc/cpuinfo; False where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return any(flag in words for flag in flags)
