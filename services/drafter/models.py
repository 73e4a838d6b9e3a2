"""Builds the draft models a drafter hosts from their specs.

A spec is `layers:N` (the target's first N layers + its final norm and LM head: works for any
target) or a model name / local HF directory sharing the target's tokenizer.
"""
from __future__ import annotations

import logging

from services.common import models
from services.common.config import Settings
from services.common.lm import CausalLM
from services.drafter.engine import DraftModel

log = logging.getLogger(__name__)


def draft_specs(settings: Settings) -> list[str]:
    if settings.drafters:
        return list(settings.drafters)
    source = models.REGISTRY.get(settings.model)
    return [source.default_draft if source else "layers:8"]


def build_draft_models(settings: Settings) -> list[DraftModel]:
    dtype = models.resolve_dtype(settings.dtype)
    target_path = models.resolve(settings.model, settings.cache_dir)
    target_vocab = None
    out = []
    for spec in draft_specs(settings):
        if spec.startswith("layers:"):
            layers = _parse_layers(spec)
            lm = CausalLM(models.load_model(target_path, dtype, num_layers=layers,
                                                     linear=settings.linear),
                          f"{settings.model}:layers={layers}")
            out.append(DraftModel(lm, lm.name, "truncated"))
        else:
            path = models.resolve(spec, settings.cache_dir)
            if target_vocab is None:
                target_vocab = models.load_tokenizer(target_path).get_vocab()
            if models.load_tokenizer(path).get_vocab() != target_vocab:
                raise ValueError(f"draft model '{spec}' does not share the tokenizer of the target "
                                 f"'{settings.model}': drafts must use the same token ids")
            lm = CausalLM(models.load_model(path, dtype, linear=settings.linear), spec)
            out.append(DraftModel(lm, spec, "model"))
        out[-1].measure()
        log.info("draft model %s: %d layers, %s, %.1f ms per drafting forward", out[-1].name,
                 out[-1].lm.num_layers, dtype, 1e3 * out[-1].level_seconds)
    return out


def _parse_layers(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"bad draft spec '{spec}': expected layers:N with N an integer") from None
