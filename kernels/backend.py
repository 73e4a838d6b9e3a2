"""Attention backend selection: the ONE place deciding which kernels serve the verifier.

The verifier builds its backend once (services/verifier/server.py, engine.py) and calls its
`attend` once per layer of every packed forward and its `compact` when accepting paths (the
calls' layout: `AttentionBackend`). Which backend runs where: `select_attention_backend`.
Triton is imported lazily: selecting or using the torch backend never imports it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from specmesh_kernels.compaction import compact_kv_torch
from specmesh_kernels.metadata import TreeBatch
from specmesh_kernels.tree_attention import tree_attention_exact, tree_attention_torch

log = logging.getLogger(__name__)

PREFERENCES = ("auto", "torch", "triton", "flash-attn")


@dataclass(frozen=True)
class AttentionBackend:
    """What the verifier calls: attend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots,
    tree_mask, mask_indptr, scale, meta=None) -> o [T, H, D] for every layer of its packed
    forward (services/verifier/packed.py), once the new rows' K/V are in the layer's KV store;
    compact(k, v, src, dst) after the tree walk, moving the accepted path's rows to the end of
    the prefix (compaction.py).

    Layout of one attend (T new rows in total, S segments, one per request: a prefill chain
    and/or the root + tree nodes):
    - q: [T, H, D] packed query rows; segment s owns rows qo_indptr[s] : qo_indptr[s + 1] (n_s).
    - k_cache, v_cache: [num_slots, KVH, D], one layer's storage; H % KVH == 0 and query head h
      reads KV head h // (H // KVH) (GQA). The new rows' K/V are already in the cache.
    - Segment s's positions 0 .. kv_len_s - 1 live at slots kv_slots[kv_indptr[s] :
      kv_indptr[s + 1]] (any slots; kv_len_s >= n_s). The first kv_len_s - n_s positions are its
      committed prefix, seen by all its rows; the last n_s are its new rows, row i sees new row j
      iff tree_mask[mask_indptr[s] + i * n_s + j] (diagonal included; a chain is lower-triangular).
    - scale: softmax scale. Output o: [T, H, D] in q's dtype, accumulated in float32."""

    name: str  # "torch" | "torch-exact" | "triton" | "flash-attn"
    attend: Callable[..., torch.Tensor]
    compact: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class PlannedAttend:
    """Wraps an attention function so that the TreeBatch of a forward is built once, not once
    per layer: every layer passes the SAME index tensor objects, so the last TreeBatch is reused
    while they are identical (`is`). References are held, so ids cannot be recycled; the index
    tensors must not be modified in place between calls (the verifier builds new ones)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self._last: tuple[tuple, TreeBatch] | None = None

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                 mask_indptr, scale: float, meta: TreeBatch | None = None) -> torch.Tensor:
        if meta is None:
            key = (qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
            last = self._last  # one read: safe if another thread replaces it meanwhile
            if last is not None and all(a is b for a, b in zip(last[0], key)):
                meta = last[1]
            else:
                meta = TreeBatch.build(*key)
                self._last = (key, meta)
        return self.fn(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                       mask_indptr, scale, meta=meta)


# ---------------------------------------------------------------------------------------------
# selection
def select_attention_backend(device: torch.device | str, prefer: str = "auto",
                             exact: bool = False) -> AttentionBackend:
    """The backend for `device`; ValueError if `prefer` is unknown or cannot run there.

    | device | prefer="auto"                         | also allowed                                 |
    | ------ | ------------------------------------- | -------------------------------------------- |
    | cuda   | flash-attn if importable, else triton | torch, triton, flash-attn (if importable)    |
    | cpu    | torch (SDPA per segment)              | triton only under TRITON_INTERPRET=1 (tests) |

    "flash-attn": the prefix part through flash_attn_varlen_func, the tree part through our
    Triton kernel, merged exactly (`tree_attention_flash`). `exact`: rows independent of the rows beside them (the torch backend's
    float64 padded path, `tree_attention_exact`, on any device). Logs the choice at INFO."""
    device = torch.device(device)
    if prefer not in PREFERENCES:
        raise ValueError(f"unknown attention backend {prefer!r}; expected one of {PREFERENCES}")
    if exact and prefer not in ("auto", "torch"):
        raise ValueError(f"exact verification runs on the torch attention backend, not {prefer}")
    name = "torch-exact" if exact else _choose(device, prefer)
    log.info("attention backend: %s (%s)", name, device.type)
    return _build(name)


def _choose(device: torch.device, prefer: str) -> str:
    if device.type != "cuda":
        if prefer in ("auto", "torch"):
            return "torch"
        if prefer == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return "triton"  # the Triton kernels in the interpreter (tests; slow)
        if prefer == "triton":
            raise ValueError(f"the triton attention backend needs CUDA (device is {device.type});"
                             " on CPU it runs only under TRITON_INTERPRET=1 (for tests)")
        raise ValueError(f"the flash-attn attention backend needs CUDA (device is {device.type})")
    if prefer == "torch":
        return "torch"
    if prefer in ("auto", "flash-attn") and _flash_attn_importable():
        return "flash-attn"
    if prefer == "flash-attn":
        raise ValueError("attention backend flash-attn requested but flash_attn is not "
                         "importable (pip install 'specmesh-server[cuda]')")
    return "triton"


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or a wheel built against another torch / CUDA
        return False
    return True


def _build(name: str) -> AttentionBackend:
    if name == "torch":
        return AttentionBackend(name, PlannedAttend(tree_attention_torch), compact_kv_torch)
    if name == "torch-exact":
        return AttentionBackend(name, PlannedAttend(tree_attention_exact), compact_kv_torch)
    from specmesh_kernels.compaction import compact_kv_triton

    attend = tree_attention_split if name == "triton" else tree_attention_flash
    return AttentionBackend(name, PlannedAttend(attend), compact_kv_triton)


# ---------------------------------------------------------------------------------------------
# triton: one tree-attention launch, or split-KV when a long request would dominate it
# Threshold and chunk measured on an H100: docs/decisions/cuda-split-kv.md
SPLIT_KV_MIN = 4096  # split-KV only once some segment's KV is longer than this
SPLIT_KV_CHUNK = 1024  # KV positions per work item once split


def tree_attention_split(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                         mask_indptr, scale: float, meta: TreeBatch | None = None,
                         chunk_size: int = SPLIT_KV_CHUNK, min_kv: int = SPLIT_KV_MIN
                         ) -> torch.Tensor:
    """The Triton backend's attend: when every segment's KV is at most max(min_kv, chunk_size)
    positions, a single tree-attention launch; otherwise SPIN's request decomposition
    (kernels/decomposed.py): segments are cut into chunks of <= chunk_size positions, every
    chunk a work item of one launch, merged exactly by log-sum-exp, so a long request does not
    serialize the batch on a few programs."""
    from specmesh_kernels.decomposed import decomposed_attention_triton
    from specmesh_kernels.tree_attention import tree_attention_triton

    meta = meta or TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    if max(meta.kv_len(s) for s in range(meta.num_segments)) <= max(min_kv, chunk_size):
        return tree_attention_triton(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots,
                                     tree_mask, mask_indptr, scale, meta=meta)
    o, _ = decomposed_attention_triton(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots,
                                       tree_mask, mask_indptr, scale, chunk_size, meta=meta)
    return o


# ---------------------------------------------------------------------------------------------
# flash-attn (CUDA only; NOT exercised by the test suite, which has no GPU)
@dataclass(frozen=True)
class _PrefixPlan:
    """flash_attn_varlen_func inputs for the prefix part, built once per forward."""

    slots: torch.Tensor  # [sum prefix_len] int64 slots of every segment's prefix, segment order
    cu_q: torch.Tensor  # [S + 1] int32 query row offsets (= qo_indptr)
    cu_k: torch.Tensor  # [S + 1] int32 offsets into the gathered prefix K/V
    max_q: int
    max_k: int
    no_prefix_rows: torch.Tensor  # [T] bool rows whose segment has no prefix


def _prefix_plan(meta: TreeBatch, device: torch.device) -> _PrefixPlan:
    segs = range(meta.num_segments)
    prefixes = [meta.prefix_len(s) for s in segs]
    parts = [meta.kv_slots[meta.kv[s]:meta.kv[s] + prefixes[s]] for s in segs]
    cu_k = [0]
    for p in prefixes:
        cu_k.append(cu_k[-1] + p)
    empty = torch.cat([torch.full((meta.n(s),), prefixes[s] == 0) for s in segs])
    return _PrefixPlan(
        slots=torch.cat(parts), cu_q=torch.tensor(meta.qo, dtype=torch.int32, device=device),
        cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_q=max(meta.n(s) for s in segs), max_k=max(prefixes), no_prefix_rows=empty.to(device))


def tree_attention_flash(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                         mask_indptr, scale: float, meta: TreeBatch | None = None
                         ) -> torch.Tensor:
    """Tree attention = merge(prefix part by flash-attn, tree part by our Triton kernel): K/V
    gathered per segment for flash_attn_varlen_func (its natural-log LSE from
    return_attn_probs=True), the tree part restricted to the new rows, merged exactly with
    merge_states_triton.

    Assumes flash-attn >= 2.4 (varlen softmax_lse is [H, total_q], natural log, and with
    dropout_p = 0 return_attn_probs=True returns (out, lse, None)), fp16/bf16 inputs (fp32 falls
    back to the Triton kernel), head_dim <= 256. For a segment without prefix (seqlen_k = 0)
    flash-attn writes out = 0 and lse = +inf, so those rows' prefix LSE is reset to -inf."""
    from flash_attn import flash_attn_varlen_func

    from specmesh_kernels.decomposed import merge_states_triton, partial_attention_triton
    from specmesh_kernels.tree_attention import tree_attention_triton

    meta = meta or TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return tree_attention_triton(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots,
                                     tree_mask, mask_indptr, scale, meta=meta)
    plan = meta.cached("flash-prefix", lambda: _prefix_plan(meta, q.device))
    tree = [(s, meta.prefix_len(s), meta.kv_len(s), 1) for s in range(meta.num_segments)]
    v, s = partial_attention_triton(q, k_cache, v_cache, meta, tree, 2, scale, "tree")
    if plan.max_k > 0:  # chunk 0 = prefix part; stays (0, -inf) when no segment has a prefix
        out, lse, _ = flash_attn_varlen_func(
            q.contiguous(), k_cache.index_select(0, plan.slots),
            v_cache.index_select(0, plan.slots), plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
            dropout_p=0.0, softmax_scale=scale, causal=False, return_attn_probs=True)
        assert lse.shape == (q.shape[1], q.shape[0]), "flash-attn < 2.4 (padded softmax_lse)"
        v[:, 0] = out.float()
        s[:, 0] = lse.t().masked_fill(plan.no_prefix_rows[:, None], float("-inf"))
    o, _ = merge_states_triton(v, s, out_dtype=q.dtype)
    return o
