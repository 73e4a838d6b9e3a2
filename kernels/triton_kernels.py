"""The Triton kernels of the package (imported lazily: importing this module imports triton).

- `tree_attn_kernel`: a block of one segment's query rows over a KV range of that segment, online
  softmax over KV blocks (Triton's tutorial 06-fused-attention), K/V gathered through the slot
  list; one range = the whole segment (tree attention) or one chunk (decomposed attention).
- `merge_states_kernel`: exact merge of C partial states per (row, head) through their LSEs.
- `compact_kernel`: KV compaction, pairs copied in order inside each program.
Work items are rows of an int32 table (`ITEM_COLS`); the grid is (work items, KV heads), a GQA
group's query heads packed as rows of one tile (K/V loaded once per group). Softmax runs in base
2; the LSE written out is natural log (decomposed.py). Without a GPU they run under
TRITON_INTERPRET=1, set before importing triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh_kernels.metadata import TreeBatch

# a work-item row: q_lo, q_hi (query rows of the item), q_seg (segment's first row), n_new
# (the tree mask's row width: the segment's new rows, or more for a draft level), kv_off
# (segment's start in kv_slots), kv_lo, kv_hi (KV positions of the item), prefix (positions
# before the mask), mask_off (segment's tree-mask block), chunk (index)
ITEM_COLS = 10
ITEM_STRIDE = tl.constexpr(ITEM_COLS)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_block(acc, m_i, l_i, q, scale_log2, K, V, SLOTS, MASK, kv_off, start, kv_hi,
                  prefix, mask_row, n_new, stride_kt, stride_kh, kvh, offs_n, offs_d, d_ok, row_ok,
                  MASKED: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """One KV block [start, start + BLOCK_N) folded into the running (acc, m, l); scores are in
    log2 units (scale_log2 = scale * log2(e))."""
    pos = start + offs_n  # [BLOCK_N] positions in the segment
    if MASKED:
        pos_ok = pos < kv_hi
        slot = tl.load(SLOTS + kv_off + pos, mask=pos_ok, other=0)
    else:
        slot = tl.load(SLOTS + kv_off + pos)
    kv_ptr = slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    k = tl.load(K + kv_ptr, mask=d_ok[None, :], other=0.0)
    v = tl.load(V + kv_ptr, mask=d_ok[None, :], other=0.0)
    # the interpreter's tl.dot multiplies bf16 bit patterns:
    # https://github.com/triton-lang/triton/issues/11584
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        j = pos - prefix  # index among the new rows (< 0: prefix)
        in_tree = (j >= 0) & pos_ok
        tree_ptr = MASK + mask_row[:, None] + j[None, :]
        seen = tl.load(tree_ptr, mask=row_ok[:, None] & in_tree[None, :], other=0)
        allowed = ((j < 0)[None, :] | (seen != 0)) & pos_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: no NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def tree_attn_kernel(Q, K, V, O, LSE, SLOTS, MASK, ITEMS,
                     stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_ot, stride_oc, stride_oh, stride_lt, stride_lc, stride_lh,
                     scale_log2, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    item = ITEMS + tl.program_id(0) * ITEM_STRIDE
    kvh = tl.program_id(1)
    q_lo, q_hi, q_seg = tl.load(item + 0), tl.load(item + 1), tl.load(item + 2)
    n_new, kv_off = tl.load(item + 3), tl.load(item + 4)
    kv_lo, kv_hi, prefix = tl.load(item + 5), tl.load(item + 6), tl.load(item + 7)
    mask_off, chunk = tl.load(item + 8), tl.load(item + 9)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row = q_lo + offs_m // GROUP  # [BLOCK_M] query row of each tile row
    head = kvh * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each tile row
    row_ok = row < q_hi
    d_ok = offs_d < HEAD_DIM
    q_ptr = Q + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    mask_row = mask_off + (row - q_seg) * n_new  # [BLOCK_M] start of each row in the tree mask

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # full blocks inside the committed prefix: no mask at all
    split = kv_lo + tl.maximum(tl.minimum(kv_hi, prefix) - kv_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_lo, split, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, scale_log2, K, V, SLOTS, MASK, kv_off,
                                      start, kv_hi, prefix, mask_row, n_new, stride_kt,
                                      stride_kh, kvh, offs_n, offs_d, d_ok, row_ok, False,
                                      PRECISION, DOT_F32)
    # the rest: prefix tail and the new rows, under bounds and tree mask
    for start in range(split, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, scale_log2, K, V, SLOTS, MASK, kv_off,
                                      start, kv_hi, prefix, mask_row, n_new, stride_kt,
                                      stride_kh, kvh, offs_n, offs_d, d_ok, row_ok, True,
                                      PRECISION, DOT_F32)

    empty = l_i == 0.0  # no visible key in this range (only possible for a tree-part chunk)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptr = O + row[:, None] * stride_ot + chunk * stride_oc + head[:, None] * stride_oh
    tl.store(o_ptr + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(LSE + row * stride_lt + chunk * stride_lc + head * stride_lh, lse, mask=row_ok)


@triton.jit
def merge_states_kernel(V, S, O, LSE, n_rows, C, H,
                        stride_vt, stride_vc, stride_vh, stride_st, stride_sc, stride_sh,
                        stride_ot, stride_oh, stride_lt, stride_lh,
                        HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merges C partial states of BLOCK_R (row, head) pairs: s = logsumexp_c s_c,
    v = sum_c exp(s_c - s) v_c (natural log). Rows whose states are all -inf get v = 0."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (row, head) index
    r_ok = r < n_rows
    t, h = r // H, r % H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    s_base = S + t * stride_st + h * stride_sh
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for c in range(0, C):
        m = tl.maximum(m, tl.load(s_base + c * stride_sc, mask=r_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    v_base = V + t[:, None] * stride_vt + h[:, None] * stride_vh + offs_d[None, :]
    for c in range(0, C):
        w = tl.exp(tl.load(s_base + c * stride_sc, mask=r_ok, other=float("-inf")) - m_safe)
        v = tl.load(v_base + c * stride_vc, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        total += w
        acc += w[:, None] * v.to(tl.float32)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    o_ptr = O + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    tl.store(LSE + t * stride_lt + h * stride_lh, lse, mask=r_ok)


@triton.jit
def compact_kernel(K, V, SRC, DST, R, stride_kl, stride_ks, width,
                   BLOCK: tl.constexpr):
    """Program (layer, slice of the KVH*D row): copies row SRC[i] -> DST[i] of that slice for
    i = 0 .. R - 1 IN ORDER, so pair i reads its source after every earlier pair has written."""
    layer = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    k_base = K + layer * stride_kl + offs
    v_base = V + layer * stride_kl + offs
    for i in range(0, R):
        src = tl.load(SRC + i).to(tl.int64)
        dst = tl.load(DST + i).to(tl.int64)
        k = tl.load(k_base + src * stride_ks, mask=ok)
        v = tl.load(v_base + src * stride_ks, mask=ok)
        tl.store(k_base + dst * stride_ks, k, mask=ok)
        tl.store(v_base + dst * stride_ks, v, mask=ok)
        tl.debug_barrier()  # same addresses, same threads; the barrier makes the order explicit


# ---------------------------------------------------------------------------------------------
# host side
def block_sizes(device: torch.device, dtype: torch.dtype, head_dim: int
                ) -> tuple[int, int, int]:
    """(BLOCK_M tile rows, BLOCK_N keys per block, BLOCK_D). tl.dot needs >= 16 on GPUs; the
    interpreter (CPU) runs programs one after another, so there few, big blocks are faster.
    fp32 with D = 128 and BLOCK_N = 64 needs 115 KB of shared memory (sm_80, measured by
    compiling): too much for sm_86/89, hence BLOCK_N = 32 for wide fp32 heads."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type == "cpu":
        return 64, 128, block_d
    if dtype == torch.float32 and block_d > 64:
        return 64, 32, block_d
    return 64, 64, block_d


def work_items(meta: TreeBatch, ranges: list[tuple[int, int, int, int]], rows_per_item: int,
               device: torch.device) -> torch.Tensor:
    """ranges: (segment, kv_lo, kv_hi, chunk index) to compute; each is split into blocks of
    rows_per_item query rows. Returns the int32 table [num_items, ITEM_COLS]."""
    rows = []
    for s, kv_lo, kv_hi, chunk in ranges:
        rows += item_rows(meta.qo[s], meta.n(s), meta.kv[s], kv_lo, kv_hi, meta.prefix_len(s),
                          meta.mask_off[s], chunk, rows_per_item)
    return torch.tensor(rows, dtype=torch.int32, device=device).view(-1, ITEM_COLS)


def item_rows(q_seg: int, n: int, kv_off: int, kv_lo: int, kv_hi: int, prefix: int,
              mask_off: int, chunk: int, rows_per_item: int, width: int = 0
              ) -> list[tuple[int, ...]]:
    """The work-item rows of one segment's KV range: its n query rows from q_seg in blocks.
    Its mask is [n, width] (0: [n, n]) over the positions from `prefix` on."""
    return [(q_lo, min(q_lo + rows_per_item, q_seg + n), q_seg, width or n, kv_off, kv_lo,
             kv_hi, prefix, mask_off, chunk) for q_lo in range(q_seg, q_seg + n, rows_per_item)]


def rows_per_item(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                  head_dim: int) -> int:
    """Query rows of one work item: a tile holds rows x the GQA group's heads."""
    block_m = block_sizes(device, dtype, head_dim)[0]
    group = heads // kv_heads
    assert group <= block_m, f"GQA group {group} larger than the tile ({block_m} rows)"
    return block_m // group


def launch_attention(q, k_cache, v_cache, meta: TreeBatch, ranges, key, scale_log2: float,
                     out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """One launch of tree_attn_kernel over `ranges` (see work_items; cached in meta under key).
    out: [T, H, D] when lse is None (whole segments), else [T, C, H, D] float32 partials with
    lse: [T, C, H] float32."""
    per_item = rows_per_item(q.device, q.dtype, q.shape[1], k_cache.shape[1], q.shape[2])
    items = meta.cached(("items", key, per_item),
                        lambda: work_items(meta, ranges, per_item, q.device))
    if items.shape[0] == 0:
        return
    launch_items(q, k_cache, v_cache, items, meta.kv_slots, meta.tree_mask_u8(), scale_log2,
                 out, lse)


def launch_items(q, k_cache, v_cache, items: torch.Tensor, kv_slots: torch.Tensor,
                 mask_u8: torch.Tensor, scale_log2: float, out: torch.Tensor,
                 lse: torch.Tensor | None = None) -> None:
    """tree_attn_kernel over a work-item table (one program per row and KV head). Everything
    it reads lives in device tensors and the grid is the table's length, so a launch over
    persistent buffers replays from a CUDA graph; an all-zero row is an empty item."""
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    group = heads // kv_heads
    block_m, block_n, block_d = block_sizes(q.device, q.dtype, head_dim)
    if lse is None:  # [T, H, D]: no chunk dimension
        o_strides, l_strides = (out.stride(0), 0, out.stride(1)), (0, 0, 0)
    else:
        assert out.dim() == 4 and lse.shape == out.shape[:3], "partials: [T, C, H, D], [T, C, H]"
        o_strides, l_strides = (out.stride(0), out.stride(1), out.stride(2)), lse.stride()
    precision = "ieee" if q.dtype == torch.float32 else None  # exact fp32 (no TF32)
    dot_f32 = q.device.type == "cpu" and q.dtype != torch.float32  # interpreter: bf16/fp16 dots
    tree_attn_kernel[(items.shape[0], kv_heads)](
        q, k_cache, v_cache, out, out if lse is None else lse, kv_slots, mask_u8, items,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), *o_strides, *l_strides,
        scale_log2, HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, WRITE_LSE=lse is not None, PRECISION=precision, DOT_F32=dot_f32)
