"""Decomposed (split-KV) tree attention: SPIN's request decomposition, merged by log-sum-exp.

SPIN (section V.A, eq. 13) cuts long requests' KV into pieces and keeps attention exact by
normalizing each row over ALL keys of its request. Every piece here yields a partial output v
and the NATURAL-log log-sum-exp s of its scaled scores (as flash_attn's softmax_lse; s = -inf,
v = 0 where a row sees no key), merged exactly the flashinfer way (cascade `merge_state`):

    s = log(exp(s_a) + exp(s_b)),   v = exp(s_a - s) * v_a + exp(s_b - s) * v_b

Deviation from SPIN: no common padded piece length and no search for it; each segment's KV is
cut into balanced chunks of at most `chunk_size` positions (docs/decisions/cuda-split-kv.md).
"""
from __future__ import annotations

from typing import Sequence

import torch

from specmesh_kernels.metadata import TreeBatch
from specmesh_kernels.tree_attention import LOG2E, check_inputs, segment_mask


def plan_chunks(kv_lens: Sequence[int], chunk_size: int) -> list[tuple[int, int, int]]:
    """Work items (segment, kv_start, kv_end): each segment's [0, kv_len) cut into
    ceil(kv_len / chunk_size) contiguous chunks of near-equal length (each <= chunk_size)."""
    assert chunk_size >= 1, "chunk_size must be >= 1"
    items = []
    for s, kv_len in enumerate(kv_lens):
        pieces = -(-kv_len // chunk_size)  # 0 for an empty segment: no items
        if pieces == 0:
            continue
        bounds = [kv_len * i // pieces for i in range(pieces + 1)]
        items += [(s, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    return items


def _chunk_ranges(meta: TreeBatch, chunk_size: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """plan_chunks as (segment, kv_lo, kv_hi, chunk index in segment), plus C = max chunks."""
    ranges, index = [], {}
    for s, lo, hi in plan_chunks([meta.kv_len(s) for s in range(meta.num_segments)], chunk_size):
        index[s] = index.get(s, -1) + 1
        ranges.append((s, lo, hi, index[s]))
    return ranges, max(index.values(), default=-1) + 1


# ---------------------------------------------------------------------------------------------
# references (float32, explicit)
def partial_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [n, H, D]; k, v: [m, KVH, D] (one piece of KV); mask: [n, m] bool. Returns the
    piece's normalized output [n, H, D] and natural-log LSE [n, H], both float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [m, H, D]
    v = v.float().repeat_interleave(group, dim=1)  # [m, H, D]
    scores = torch.einsum("ihd,jhd->ihj", q.float(), k) * scale  # [n, H, m]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, H]; -inf where the row sees nothing
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # 0 where masked
    return torch.einsum("ihj,jhd->ihd", probs, v), lse


def merge_state_ref(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two states: v: [..., D], s: [...] natural-log LSE. Returns (v float32, s)."""
    s = torch.logaddexp(s_a, s_b)  # -inf only when both are -inf
    s_safe = s.nan_to_num(neginf=0.0)  # avoid -inf - -inf = NaN
    w_a, w_b = torch.exp(s_a - s_safe), torch.exp(s_b - s_safe)  # 0 for a -inf state
    return w_a[..., None] * v_a.float() + w_b[..., None] * v_b.float(), s


def merge_states_ref(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [T, C, H, D], s: [T, C, H] -> (v [T, H, D] float32, s [T, H]), folding merge_state_ref
    over the C states in order."""
    assert v.dim() == 4 and s.shape == v.shape[:3], "v: [T, C, H, D], s: [T, C, H]"
    out_v, out_s = v[:, 0].float(), s[:, 0].float()
    for c in range(1, v.shape[1]):
        out_v, out_s = merge_state_ref(out_v, out_s, v[:, c], s[:, c])
    return out_v, out_s


def decomposed_attention_ref(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                             mask_indptr, scale: float, chunk_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree attention as chunks merged one by one. Returns (o [T, H, D] in q's dtype,
    lse [T, H] float32 over each row's whole visible KV)."""
    meta = TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    check_inputs(q, k_cache, v_cache, meta)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [T, H, D]
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)  # [T, H]
    kv_lens = [meta.kv_len(s) for s in range(meta.num_segments)]
    for s, lo, hi in plan_chunks(kv_lens, chunk_size):
        rows = slice(meta.qo[s], meta.qo[s + 1])
        slots = meta.kv_slots[meta.kv[s] + lo:meta.kv[s] + hi]
        mask = segment_mask(meta, s)[:, lo:hi]  # [n, hi - lo]
        v_c, s_c = partial_attention_ref(q[rows], k_cache[slots], v_cache[slots], mask, scale)
        out[rows], lse[rows] = merge_state_ref(out[rows], lse[rows], v_c, s_c)
    return out.to(q.dtype), lse


# ---------------------------------------------------------------------------------------------
# Triton
def partial_attention_triton(q, k_cache, v_cache, meta: TreeBatch,
                             ranges: list[tuple[int, int, int, int]], num_chunks: int,
                             scale: float, key) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over ranges (segment, kv_lo, kv_hi, chunk index < num_chunks). Returns the
    partial states v: [T, C, H, D] float32 and s: [T, C, H] float32 (C = num_chunks); entries
    no range wrote stay (v = 0, s = -inf). key names the ranges in meta's cache."""
    from specmesh_kernels import triton_kernels as tk  # lazy: the CPU serving path never imports triton

    check_inputs(q, k_cache, v_cache, meta)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "D contiguous"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ"
    rows, heads, dim = q.shape
    v = torch.zeros(rows, num_chunks, heads, dim, dtype=torch.float32, device=q.device)
    s = torch.full((rows, num_chunks, heads), float("-inf"), device=q.device)
    tk.launch_attention(q, k_cache, v_cache, meta, ranges, key, scale * LOG2E, v, s)
    return v, s


def merge_states_triton(v: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [T, C, H, D], s: [T, C, H] float32 -> (v [T, H, D] in out_dtype (default v's dtype),
    s [T, H] float32). One launch, BLOCK_R (row, head) pairs per program."""
    from specmesh_kernels import triton_kernels as tk

    assert v.dim() == 4 and s.shape == v.shape[:3], "v: [T, C, H, D], s: [T, C, H]"
    assert s.dtype == torch.float32 and v.stride(3) == 1, "s float32, v's D contiguous"
    assert v.device == s.device, "v and s on different devices"
    rows, chunks, heads, dim = v.shape
    out = torch.empty(rows, heads, dim, dtype=out_dtype or v.dtype, device=v.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=v.device)
    pairs = rows * heads
    block_r = 64 if v.device.type == "cpu" else 16
    if pairs:
        tk.merge_states_kernel[(-(-pairs // block_r),)](
            v, s, out, lse, pairs, chunks, heads, v.stride(0), v.stride(1), v.stride(2),
            s.stride(0), s.stride(1), s.stride(2), out.stride(0), out.stride(1), lse.stride(0),
            lse.stride(1), HEAD_DIM=dim, BLOCK_R=block_r,
            BLOCK_D=tk.triton.next_power_of_2(dim))
    return out, lse


def decomposed_attention_triton(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                                mask_indptr, scale: float, chunk_size: int,
                                meta: TreeBatch | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `decomposed_attention_ref`: every (segment, chunk, query block) is a
    work item of ONE attention launch, then one merge launch."""
    meta = meta or TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    ranges, num_chunks = meta.cached(("chunks", chunk_size),
                                     lambda: _chunk_ranges(meta, chunk_size))
    v, s = partial_attention_triton(q, k_cache, v_cache, meta, ranges, num_chunks, scale,
                                    ("chunks", chunk_size))
    return merge_states_triton(v, s, out_dtype=q.dtype)
