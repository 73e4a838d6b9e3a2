"""Tree attention over a packed, ragged batch: reference, CPU serving path, Triton kernel.

The verifier's packed forward (services/verifier/packed.py) calls one of these once per layer,
after writing the new rows' K/V into the cache: each segment's query rows attend its committed
prefix (all of it) and its own new rows (under the tree mask), read through its slot list.
Layout: backend.AttentionBackend.
- `tree_attention_ref`: float32, explicit scores / mask / softmax per segment (the oracle).
- `tree_attention_torch`: the CPU serving path: one-row segments as one padded batch of float32
  matmuls, the others by SDPA per segment (docs/decisions/cpu-tree-attention.md).
- `tree_attention_triton`: one launch of triton_kernels.tree_attn_kernel over (segment q-block,
  KV head) work items; triton is imported on first call only.
All three return o: [T, H, D] in q's dtype; the fast two accept `meta=TreeBatch.build(...)`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specmesh_kernels.metadata import PaddedSegments, TreeBatch

LOG2E = 1.4426950408889634


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: TreeBatch) -> None:
    """Shape / dtype / device asserts shared by every attention entry point."""
    assert q.dim() == 3 and k_cache.dim() == 3, "q: [T, H, D], k_cache: [num_slots, KVH, D]"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q, k_cache, v_cache dtypes differ"
    assert q.is_floating_point(), "attention needs floating-point q/k/v"
    assert q.shape[2] == k_cache.shape[2], "head dims of q and k_cache differ"
    assert q.shape[1] % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.shape[0] == meta.num_rows, f"q has {q.shape[0]} rows, qo_indptr says {meta.num_rows}"
    assert q.device == k_cache.device == meta.kv_slots.device == meta.tree_mask.device, "devices"


# ---------------------------------------------------------------------------------------------
# reference
def segment_mask(meta: TreeBatch, s: int) -> torch.Tensor:
    """Segment s's visibility [n_s, kv_len_s] bool: prefix all True, then the tree block."""
    n, prefix = meta.n(s), meta.prefix_len(s)
    prefix_part = torch.ones(n, prefix, dtype=torch.bool, device=meta.tree_mask.device)
    return torch.cat([prefix_part, meta.tree_block(s)], dim=1)


def tree_attention_ref(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                       mask_indptr, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [num_slots, KVH, D]. Returns o: [T, H, D] (q's dtype),
    computed in float32 with explicit scores, mask and softmax, one segment at a time."""
    meta = TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    check_inputs(q, k_cache, v_cache, meta)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [T, H, D]
    for s in range(meta.num_segments):
        slots = meta.kv_slots[meta.kv[s]:meta.kv[s + 1]]
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        qs = q[meta.qo[s]:meta.qo[s + 1]].float()  # [n, H, D]
        scores = torch.einsum("ihd,jhd->hij", qs, k) * scale  # [H, n, kv_len]
        scores = scores.masked_fill(~segment_mask(meta, s), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[meta.qo[s]:meta.qo[s + 1]] = torch.einsum("hij,jhd->ihd", probs, v)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# CPU serving path
# Segments with at most this many new rows go through `_padded_attention`. One: from 2 rows on
# SDPA is as fast as the padded matmuls (docs/decisions/cpu-tree-attention.md).
SMALL_SEGMENT_ROWS = 1
# A lone request's step of at most this many rows (its plain step, its tree; trees in a float32
# cache only) goes through `_lone_segment` (the rest, prefill chunks, the generic paths)
LONE_ROWS = 4
# exact: plain decoding's one row and every verify tree (up to this many rows) take the padded
# path in float64, prefill chunks SDPA (docs/decisions/cpu-tree-attention.md)
EXACT_SEGMENT_ROWS = 64


def tree_attention_torch(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                         mask_indptr, scale: float, meta: TreeBatch | None = None,
                         small_rows: int = SMALL_SEGMENT_ROWS, exact: bool = False,
                         lone: bool = True) -> torch.Tensor:
    """Same contract as `tree_attention_ref`. A lone segment of one row (one request's plain
    step), or of up to LONE_ROWS in a float32 cache (its tree), by `_lone_segment` (`lone`).
    Otherwise segments of at most `small_rows` new rows (a plain decoding step: the root alone)
    all at once by `_padded_attention`; the others (trees, prefill chunks) by SDPA per segment
    in q's dtype (SDPA accumulates in float32 internally).

    Why not SDPA for all: torch's CPU flash kernel is built for blocks of query rows and is
    several times slower than two matmuls for one row, once per segment per layer
    (docs/decisions/cpu-tree-attention.md).

    `exact`: the padded path in float64 for segments of up to EXACT_SEGMENT_ROWS rows, so that a
    row's bits do not depend on the rows beside it (`_padded_attention`); `tree_attention_exact`."""
    if exact:
        small_rows = max(small_rows, EXACT_SEGMENT_ROWS)
    meta = meta or TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    check_inputs(q, k_cache, v_cache, meta)
    if lone and not exact and meta.num_segments == 1 and (meta.num_rows == 1 or (
            meta.num_rows <= LONE_ROWS and k_cache.dtype == torch.float32)):
        start, end = meta.kv_start(0), meta.kv_len(0)
        if start is not None:  # consecutive slots: views of the cache
            end += start
            k, v = k_cache[start:end], v_cache[start:end]
        else:
            k, v = k_cache.index_select(0, meta.kv_slots), v_cache.index_select(0, meta.kv_slots)
        return _lone_segment(q, k, v, meta, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, H, D]
    padded = meta.padded(small_rows) if small_rows else None
    if padded is not None:
        _padded_attention(q, k_cache, v_cache, padded, scale, out,
                          torch.float64 if exact else torch.float32)
    done = set(padded.segments) if padded is not None else set()
    if len(done) == meta.num_segments:
        return out
    gqa = q.shape[1] != k_cache.shape[1]
    gathered: list[torch.Tensor] = []  # K and V of every segment's slots, gathered once
    for s, mask in enumerate(meta.sdpa_masks()):
        a, b, c, d = meta.qo[s], meta.qo[s + 1], meta.kv[s], meta.kv[s + 1]
        if a == b or s in done:
            continue
        start = meta.kv_start(s)
        if start is not None:  # consecutive slots: a view of the cache
            k_all, v_all, c, d = k_cache, v_cache, start, start + d - c
        else:
            if not gathered:
                gathered += [k_cache.index_select(0, meta.kv_slots),  # [sum kv_len, KVH, D]
                             v_cache.index_select(0, meta.kv_slots)]
            k_all, v_all = gathered
        # one row sees its whole KV (prefix + itself): no mask at all, SDPA's cheapest path
        causal = mask is None and b - a > 1
        if b - a == 1:
            mask = None
        # 4D inputs: torch's CPU flash kernel (3D ones fall back to the 2-3x slower math path)
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k_all[c:d].transpose(0, 1)[None],
            v_all[c:d].transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=gqa)  # [1, H, n, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


def _lone_segment(q, k: torch.Tensor, v: torch.Tensor, meta: TreeBatch, scale: float
                  ) -> torch.Tensor:
    """A lone request's few new rows (a plain step, a tree) over its positions `k`, `v` [K,
    KVH, D] in order (cache slices, or gathered): scores (the tree block as an additive mask),
    softmax and output by two matmuls batched over the KV heads, in float32. SDPA's fixed cost
    per call and `_padded_attention`'s tables and copies are most of a layer's attention at
    these sizes (docs/decisions/cpu-tree-attention.md); a bf16 cache's trees stay with SDPA,
    which reads bf16 as it is where this path converts K/V. One row: the products of
    `_padded_attention`'s one-row path, the same bits."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    group = heads // kvh
    k, v = k.float(), v.float()  # views for a float32 cache
    if n == 1:  # query head h = kvh * G + g reads KV head kvh
        scores = torch.bmm(q.float().view(kvh, group, d), k.permute(1, 2, 0)).mul_(scale)
    else:  # rows ordered (row, g) within a KV head: [KVH, N * G, D]
        qs = q.float().view(n, kvh, group, d).transpose(0, 1).reshape(kvh, n * group, d)
        bias = meta.cached(("lone-bias", group), lambda: _tree_bias(meta, group))
        scores = torch.baddbmm(bias, qs, k.permute(1, 2, 0), alpha=scale)  # [KVH, N * G, K]
    o = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # [KVH, N * G, D]
    return o.view(kvh, n, group, d).transpose(0, 1).reshape(n, heads, d).to(q.dtype)


def _tree_bias(meta: TreeBatch, group: int) -> torch.Tensor:
    """Segment 0's visibility as an additive float32 mask [N * G, K] (0 or -inf; rows (row,
    g)): the prefix visible to every row, the tree block over the last N positions."""
    n, length = meta.n(0), meta.kv_len(0)
    bias = torch.zeros(n, length, device=meta.tree_mask.device)
    bias[:, length - n:].masked_fill_(~meta.tree_block(0), float("-inf"))
    return bias.repeat_interleave(group, dim=0)


def _padded_attention(q, k_cache, v_cache, padded: PaddedSegments, scale: float,
                      out: torch.Tensor, acc: torch.dtype = torch.float32) -> None:
    """Short segments as one padded batch: scores and output by two batched matmuls, scores,
    softmax and the weighted sum in `acc` (float32: at least SDPA's precision, which rounds the
    probabilities to q's dtype before the second product). Writes their rows of `out`.

    float64 makes a row's output independent of the rows, segments and padding beside it:
    BLAS picks its kernels and summation order by the products' shapes, so in float32 a row's
    bits change with the rows beside it, the padding after its positions and the masked
    positions between them; in float64 those differences are ~1e-16 relative and vanish in the
    final rounding (docs/decisions/cpu-tree-attention.md)."""
    p, n = padded.rows.shape
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    # [P, N, H, D] -> [P, KVH, G * N, D]: query head h = kvh * G + g reads KV head kvh
    if padded.one_row:  # plain decoding steps: the same layout without the copies
        qs = q[padded.rows[:, 0]].view(p, kvh, group, d).to(acc)
    else:
        qs = q[padded.rows].view(p, n, kvh, group, d).permute(0, 2, 3, 1, 4)
        qs = qs.reshape(p, kvh, group * n, d).to(acc)
    # K/V gathered once as [P, K, KVH, D] (index_select: advanced indexing costs ~3x) and read
    # per KV head through strided views that BLAS takes as they are: a matmul over one permuted
    # [P, KVH, K, D] copies both operands first (docs/decisions/cpu-tree-attention.md)
    k_max = padded.slots.shape[1]
    if padded.kv_start is not None:  # one segment in consecutive slots: views, no copies
        k = k_cache[padded.kv_start:padded.kv_start + k_max].view(p, k_max, kvh, d).to(acc)
        v = v_cache[padded.kv_start:padded.kv_start + k_max].view(p, k_max, kvh, d).to(acc)
    else:
        flat = padded.slots.view(-1)
        k = k_cache.index_select(0, flat).view(p, k_max, kvh, d).to(acc)
        v = v_cache.index_select(0, flat).view(p, k_max, kvh, d).to(acc)
    if p == 1:  # one segment: a batch over the KV heads, the same strided views per head
        scores = torch.bmm(qs[0], k[0].permute(1, 2, 0))[None].mul_(scale)
    else:
        scores = torch.stack([torch.bmm(qs[:, h], k[:, :, h].transpose(1, 2))
                              for h in range(kvh)], dim=1).mul_(scale)  # [P, KVH, G * N, K]
    if not padded.all_visible:
        scores = scores.view(p, kvh, group, n, -1).masked_fill_(
            ~padded.visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores.view(p, kvh, group * n, -1), dim=-1)
    if p == 1:
        o = torch.bmm(probs[0], v[0].transpose(0, 1))[None]
    else:
        o = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(kvh)],
                        dim=1)  # [P, KVH, G * N, D]
    if padded.one_row:
        out[padded.out_rows] = o.view(p, kvh * group, d).to(out.dtype)
        return
    o = o.view(p, kvh, group, n, d).permute(0, 3, 1, 2, 4).reshape(p * n, kvh * group, d)
    out[padded.out_rows] = o[padded.out_index].to(out.dtype)  # [P * N, H, D], real rows


# rows independent of the rows beside them (the verifier's `exact` mode)
tree_attention_exact = functools.partial(tree_attention_torch, exact=True)


# ---------------------------------------------------------------------------------------------
# Triton
def tree_attention_triton(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_slots, tree_mask,
                          mask_indptr, scale: float, meta: TreeBatch | None = None
                          ) -> torch.Tensor:
    """Same contract as `tree_attention_ref`, one Triton launch (CUDA, or CPU under
    TRITON_INTERPRET=1). Work items: (segment, block of query rows) x KV head."""
    from specmesh_kernels import triton_kernels as tk  # lazy: the CPU serving path never imports triton

    meta = meta or TreeBatch.build(qo_indptr, kv_indptr, kv_slots, tree_mask, mask_indptr)
    check_inputs(q, k_cache, v_cache, meta)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "D contiguous"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    ranges = [(s, 0, meta.kv_len(s), 0) for s in range(meta.num_segments)]
    tk.launch_attention(q, k_cache, v_cache, meta, ranges, "whole", scale * LOG2E, out, None)
    return out
