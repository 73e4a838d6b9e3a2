"""Builds the draft models a drafter hosts from their specs (docs/drafters.md, Draft specs).

A spec is `layers:N` (the target's first N layers + its final norm and LM head) or a model name
/ local HF directory sharing the target's tokenizer, optionally followed by `@int8` (FBGEMM,
dynamically quantized activations), `@int4` (4-bit groups of 32, torch's CPU int4 kernel) or
`@auto` (int4 on AVX512, int8 elsewhere: docs/decisions/draft-quantization.md); float32 around
the quantized products (kernels/linear_rules.py). The spec, suffix included, is the draft's name (a
router arm): one model with and without `@int4` is two drafters of different cost. Llama /
Qwen2 drafts run through the lean decoder loop (lean.py, `draft_runner`); a draft model with a
GGUF file runs on llama.cpp's kernels with `draft_runner` ggml (ggml_lm.py).
"""
from __future__ import annotations

import logging

import torch

from specmesh_kernels.linear_rules import pack_linears, quantize_linears
from specmesh_services.common import datastore_files, models
from specmesh_services.common.config import Settings, SettingsError
from specmesh_services.common.device import resolve_device
from specmesh_services.common.drafts import model_specs
from specmesh_services.common.lm import CausalLM
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.ggml_lm import GgmlDraftLM
from specmesh_services.drafter.lean import LeanLM
from specmesh_services.drafter.lean import supports as lean_supports
from specmesh_services.drafter.paged import PagedLM
from specmesh_services.drafter.spec import DraftSpec
from specmesh_services.drafter.vocab import frequent_tokens, restrict_vocab, token_counts

log = logging.getLogger(__name__)


def linear_converter(spec: DraftSpec, settings: Settings):
    """What turns a draft's torch linears into its kernels: int8 / int4 weights for a quantized
    spec (`quantize_linears`), else the configured packing (`pack_linears`)."""
    weights = spec.quantized(resolve_device(settings.device))
    if weights is not None:
        return lambda module: quantize_linears(module, weights)
    return lambda module: pack_linears(module, settings.linear)


def load_draft(spec: DraftSpec, settings: Settings, target_path,
               keep: torch.Tensor | None = None, convert: bool = True):
    """The transformers model of a draft spec, in the configured dtype or with int8 / int4
    weights (a float32 model whose linears are quantized), its LM head cut to the token ids
    `keep` when given (`draft_vocabulary`, vocab.py). `convert=False`: torch's linears left as
    they are (float32 for a quantized spec), for `LeanLM` to fuse first. No tokenizer check
    (the caller's)."""
    device = resolve_device(settings.device)
    dtype = (torch.float32 if spec.quantized(device) is not None
             else models.resolve_dtype(settings.dtype, device))
    path = target_path if spec.layers is not None else models.resolve(spec.base,
                                                                       settings.cache_dir)
    model = models.load_model(path, dtype, num_layers=spec.layers, linear="torch", device=device)
    if keep is not None:
        restrict_vocab(model, keep)
    if convert:
        linear_converter(spec, settings)(model)
    return model


def ggml_draft(spec: DraftSpec, settings: Settings) -> bool:
    """Whether the draft runs on llama.cpp's kernels: `draft_runner` ggml, refused with the
    reason for what llama.cpp cannot run (a layers:N draft, a torch quantization asked, no
    GGUF file, no CUDA kernels here, llama-cpp-python missing). `auto` keeps the torch draft:
    beside a llama.cpp target the 0.5B drafted at the same cost a level and prefilled at 1.8x
    the cost (docs/decisions/ggml-target.md)."""
    from specmesh_services.common.ggml_model import available

    if settings.draft_runner != "ggml":
        return False
    reason = None
    if spec.layers is not None:
        reason = "layers:N drafts are cut from the torch target; llama.cpp loads whole files"
    elif spec.weights not in (None, "auto"):
        reason = f"@{spec.weights} is a torch quantization; llama.cpp runs the GGUF's own weights"
    elif resolve_device(settings.device).type != "cpu":
        reason = "llama.cpp's kernels here are CPU ones"
    elif (missing := available()) is not None:
        reason = missing
    else:
        try:
            models.gguf_file(spec.base, settings.cache_dir)
        except models.ModelNotFound as err:
            reason = str(err)
    if reason is not None:
        raise SettingsError(f"draft_runner=ggml cannot run the draft '{spec.base}': {reason}")
    return True


def load_draft_lm(spec: DraftSpec, settings: Settings, target_path, label: str,
                  keep: torch.Tensor | None = None) -> CausalLM | LeanLM | GgmlDraftLM:
    """The draft's forward: llama.cpp's on its GGUF file where `ggml_draft` says so, else
    `LeanLM` where `settings.draft_runner` and the architecture allow it (lean.py), else
    transformers' (`CausalLM`)."""
    if ggml_draft(spec, settings):
        return GgmlDraftLM(models.gguf_file(spec.base, settings.cache_dir), label,
                           n_ctx=settings.verifier.kv_budget_tokens,
                           n_batch=settings.verifier.max_batch_tokens, token_ids=keep)
    model = load_draft(spec, settings, target_path, keep, convert=False)
    reason = lean_supports(model)
    if settings.draft_runner == "lean" and reason is not None:
        raise ValueError(f"draft_runner=lean: {reason}")
    if settings.draft_runner != "transformers" and reason is None:
        prepare = linear_converter(spec, settings)
        if model.device.type == "cuda" and settings.draft_graph_rows:
            return PagedLM(model, label, 2 * settings.verifier.kv_budget_tokens,
                           settings.draft_graph_rows, prepare=prepare, ops=settings.decoder_ops)
        return LeanLM(model, label, prepare=prepare, ops=settings.decoder_ops)
    linear_converter(spec, settings)(model)
    return CausalLM(model, label)


def draft_vocabulary(settings: Settings, target_path) -> torch.Tensor:
    """The `draft_vocab` most frequent token ids of the target's datastore corpus, plus the
    tokenizer's special tokens (vocab.py)."""
    tokenizer = models.load_tokenizer(target_path)
    try:
        store_path = datastore_files.locate(settings, tokenizer)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"draft_vocab={settings.draft_vocab} counts tokens in the datastore's "
                         f"corpus: {exc}") from None
    vocab_size = models.load_config(target_path).vocab_size
    counts = token_counts(store_path / "tokens.u32", vocab_size)
    keep = frequent_tokens(counts, settings.draft_vocab, tokenizer.all_special_ids)
    covered = counts[keep.numpy()].sum() / max(1, counts.sum())
    log.info("draft vocabulary: %d of %d tokens (%.1f%% of the corpus's tokens)", keep.numel(),
             vocab_size, 100 * covered)
    return keep


def build_draft_models(settings: Settings) -> list[DraftModel]:
    target_path = models.resolve(settings.model, settings.cache_dir)
    target_vocab = None
    # one vocabulary for every draft: the target's tokens, counted once
    keep = draft_vocabulary(settings, target_path) if settings.draft_vocab else None
    out = []
    for name in model_specs(settings):
        spec = DraftSpec.parse(name)
        label = name
        if spec.layers is not None:
            label = f"{settings.model}:layers={spec.layers}" + name[len(spec.base):]
        else:
            path = models.resolve(spec.base, settings.cache_dir)
            if target_vocab is None:
                target_vocab = models.load_tokenizer(target_path).get_vocab()
            if models.load_tokenizer(path).get_vocab() != target_vocab:
                raise ValueError(f"draft model '{spec.base}' does not share the tokenizer of the "
                                 f"target '{settings.model}': drafts must use the same token ids")
        lm = load_draft_lm(spec, settings, target_path, label, keep)
        if isinstance(lm, PagedLM):
            log.info("draft model %s: %d CUDA graphs captured in %.2f s", label,
                     len(lm.graphs.buckets), lm.capture_all())
        out.append(DraftModel(lm, label, "truncated" if spec.layers is not None else "model"))
        out[-1].measure()
        ggml = isinstance(lm, GgmlDraftLM)
        log.info("draft model %s: %d layers, %s, %s forward, %.1f ms per drafting forward",
                 out[-1].name, lm.num_layers,
                 "its GGUF weights" if ggml else spec.quantized(lm.device) or lm.dtype,
                 "llama.cpp" if ggml else "lean, graphs" if isinstance(lm, PagedLM)
                 else "lean" if isinstance(lm, LeanLM) else "transformers",
                 1e3 * out[-1].level_seconds)
    return out
