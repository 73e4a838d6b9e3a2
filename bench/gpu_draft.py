"""bench.gpu's `draft` part: a draft model's drafting levels, eager over per-request buffers
(`LeanLM`) beside the paged forward replayed from CUDA graphs (`PagedLM`, the CUDA default),
for a Qwen2 draft shape with random weights: ms a level by batch, context and level width."""
from __future__ import annotations

import os
import statistics
import time

import torch

from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.lean import LeanLM
from specmesh_services.drafter.paged import PagedLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def draft_costs(model, contexts: list[int], batches: list[int], widths: list[int], reps: int,
                depth: int = 4, warmup: int = 2) -> dict:
    """ms a level of `DraftModel.draft_many` (trees of `depth` levels of width w for b requests
    at context L, the call's wall time over `depth`; each call commits a token, so every call
    drafts from a new root) with each forward; the graphs' capture seconds."""
    device = model.device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (max(batches), max(contexts)), generator=gen).tolist()
    capacity = max(batches) * (max(contexts) + (warmup + reps) * depth * max(widths) + 64)
    out: dict = {"cells": []}
    graphs = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"  # CPU: dry run
    for kind in ("eager", "graphs") if graphs else ("eager",):
        lm = LeanLM(model, kind) if kind == "eager" else PagedLM(model, kind, 2 * capacity)
        if isinstance(lm, PagedLM):
            out["capture_s"] = lm.capture_all()
        draft = DraftModel(lm, kind, "model")
        for length in contexts:
            for b in batches:
                ids = [f"{kind}-{j}" for j in range(b)]
                for j, rid in enumerate(ids):
                    draft.prefill(rid, prompts[j][:length])
                for width in widths:
                    times = []
                    for rep in range(warmup + reps):
                        new = [[int(torch.randint(0, vocab, (), generator=gen))] for _ in ids]
                        _sync(device)
                        start = time.perf_counter()
                        draft.draft_many([(rid, n, depth, width) for rid, n in zip(ids, new)])
                        _sync(device)
                        if rep >= warmup:
                            times.append(time.perf_counter() - start)
                    out["cells"].append({"forward": kind, "context": length, "batch": b,
                                         "width": width,
                                         "ms_level": 1e3 * statistics.median(times) / depth})
                for rid in ids:
                    draft.release(rid)
        del lm, draft
    return out


def draft_table(shape: str, dtype: str, result: dict) -> list[str]:
    """The part's markdown: a row per (batch, context, width), eager and graphs side by side."""
    cells = {(c["forward"], c["batch"], c["context"], c["width"]): c["ms_level"]
             for c in result["cells"]}
    keys = sorted({k[1:] for k in cells})
    capture = result.get("capture_s")
    lines = [f"Draft model levels, {shape} shape (random {dtype} weights), ms a level of "
             "`DraftModel.draft_many` (trees of 4 levels), the lean forward eager beside the "
             "paged one replayed from CUDA graphs"
             + (f" (captured in {capture:.1f} s)" if capture else "") + ":", "",
             "| batch | context | width | eager | graphs | eager / graphs |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, length, width in keys:
        eager, graphs = cells.get(("eager", b, length, width)), cells.get(("graphs", b, length,
                                                                           width))
        ratio = f"{eager / graphs:.2f}x" if eager and graphs else "-"
        lines.append(f"| {b} | {length} | {width} | {_ms(eager)} | {_ms(graphs)} | {ratio} |")
    return [*lines, ""]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
