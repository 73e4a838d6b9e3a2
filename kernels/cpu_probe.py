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
    threads = torch.get_num_threads()
    # one thread: a parallel product here would give the calling thread an OpenMP team of its
    # own, and with more OpenMP threads than cores libgomp stops spinning at every barrier of
    # every team (llama.cpp's decode ran 1.45x slower after a probe on the event-loop thread)
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            layer(nn.Linear(features, 16))(torch.ones(2, features))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0] or type(exc).__name__
    finally:
        torch.set_num_threads(threads)
    return None


def cpu_has(*flags: str) -> bool:
    """Whether this (Linux) CPU reports any of `flags` in /proc/cpuinfo; False where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return any(flag in words for flag in flags)
