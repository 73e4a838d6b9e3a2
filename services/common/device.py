"""Where a role's models and caches live: the `device` setting resolved against what torch sees.

`auto` is the first GPU when torch sees one, else the CPU. A CUDA device torch cannot see is a
`SettingsError` at start-up (the CLI prints it in one line, exit 2), never a failure on the first
request. The datastore and the pool stay on the CPU whatever this says.
"""
from __future__ import annotations

import os

import torch

from specmesh_services.common.config import DEVICE_PATTERN, SettingsError

__all__ = ["check", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """The torch device `name` (auto | cpu | cuda | cuda:N) means on this machine."""
    if DEVICE_PATTERN.fullmatch(name) is None:
        raise SettingsError(f"device '{name}': expected auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else "no GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
        raise SettingsError(f"device '{name}': torch sees no CUDA device ({why}); "
                            f"use --device cpu or auto")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise SettingsError(f"device '{name}': torch sees {torch.cuda.device_count()} CUDA "
                            f"device(s) (0..{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def check(settings) -> torch.device:
    """The device `settings` serve on, refusing what it cannot serve on CUDA: `verifier.exact`
    (row-independent linears), early pruning, the CPU linear kernels, native 4-bit weights;
    `decoder_ops=triton` off CUDA but in Triton's interpreter (tests);
    the llama.cpp target (`target_runner=ggml`) serves on the CPU (auto: there), with
    llama-cpp-python installed, without early pruning or `verifier.exact`."""
    device = resolve_device(settings.device)
    if settings.target_runner == "ggml":
        if settings.device == "auto":
            device = torch.device("cpu")
        if device.type == "cuda":
            raise SettingsError("target_runner=ggml runs llama.cpp's CPU kernels: use --device "
                                "cpu with it (or the torch target on the GPU)")
        from specmesh_services.common.ggml_model import available

        if (why := available()) is not None:
            raise SettingsError(f"target_runner=ggml: {why}")
        if settings.verifier.prune != "off":
            raise SettingsError("target_runner=ggml runs no early pruning (it reads the torch "
                                "target's hidden states mid-forward): use verifier.prune=off "
                                "or another target_runner")
        if settings.verifier.exact:
            raise SettingsError("verifier.exact needs the torch target: llama.cpp computes a "
                                "row differently with other rows beside it "
                                "(docs/decisions/ggml-target.md)")
    if device.type != "cuda" and settings.decoder_ops == "triton" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise SettingsError("decoder_ops=triton runs its kernels on CUDA: use --device cuda, "
                            "or decoder_ops=auto or torch on the CPU")
    if device.type == "cuda":
        if settings.verifier.exact:
            raise SettingsError("verifier.exact needs --device cpu: its row-independent linear "
                                "kernels run on the CPU only (docs/gpu.md)")
        if settings.verifier.prune != "off":
            raise SettingsError("early pruning (verifier.prune) runs on the CPU only for now: "
                                "use --device cpu or verifier.prune=off")
        if settings.linear in ("onednn", "fp16"):
            raise SettingsError(f"linear={settings.linear} names a CPU kernel: on CUDA the "
                                f"models keep torch's linears (linear=auto or torch)")
        if settings.target_weights == "native":
            raise SettingsError("target_weights=native needs --device cpu: the int4 kernel runs "
                                "on the CPU only; on CUDA the target runs in bf16 (or fp32)")
    return device
