"""KV compaction: accepting a tree path moves its rows to the end of the committed prefix.

After the tree walk (services/common/kv.py: KVStore.commit) the rows of the root and the
accepted nodes, at positions base + keep[i], must sit at base + i. The store turns that into
slot pairs (src[i] -> dst[i]) and calls the backend's `compact` once per request, for ALL layers
(k_cache, v_cache: [L, num_slots, KVH, D]). Semantics: the pairs are processed IN ORDER, as if
`for i: cache[:, dst[i]] = cache[:, src[i]]` (why it matters: `compact_kv_triton`).
"""
from __future__ import annotations

import torch


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
           dst_slots: torch.Tensor) -> None:
    assert k_cache.dim() == 4, "k_cache: [L, num_slots, KVH, D]"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype, "k/v caches differ"
    assert src_slots.dim() == 1 and src_slots.shape == dst_slots.shape, "src, dst: [R]"
    assert not src_slots.is_floating_point() and not dst_slots.is_floating_point(), "int slots"
    assert src_slots.device == dst_slots.device == k_cache.device == v_cache.device, "devices"


def compact_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
    """In place: for i in order, every layer's row src_slots[i] copied to dst_slots[i]."""
    _check(k_cache, v_cache, src_slots, dst_slots)
    for src, dst in zip(src_slots.tolist(), dst_slots.tolist()):
        k_cache[:, dst] = k_cache[:, src]
        v_cache[:, dst] = v_cache[:, src]


def compact_kv_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                     dst_slots: torch.Tensor) -> None:
    """Vectorized (gather all sources, then scatter): equal to the in-order semantics whenever
    no pair reads a slot an earlier pair wrote, which holds for accepted paths (dst ascending,
    dst[i] <= src[i] in positions). The torch backend's `compact`."""
    _check(k_cache, v_cache, src_slots, dst_slots)
    k_cache[:, dst_slots] = k_cache[:, src_slots]
    v_cache[:, dst_slots] = v_cache[:, src_slots]


def compact_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """In place, in-order semantics (module docstring); one launch over (layer, slice of the
    KVH * D row). In positions dst[i] <= src[i], both ascending, so a later pair can write a row
    an earlier pair reads: keep = [0, 2, 3] gives moves 2 -> 1 and 3 -> 2, slot(2) the source of
    the first and the destination of the second. A parallel copy (one thread per pair) may store
    row 3 into slot(2) before the first pair loaded it; the kernel therefore loops over the pairs
    in order inside each program and parallelizes over layers and a row's KVH * D elements,
    which no two programs share."""
    from specmesh_kernels import triton_kernels as tk  # lazy: the CPU serving path never imports triton

    _check(k_cache, v_cache, src_slots, dst_slots)
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ"
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == k_cache.shape[3], "rows contiguous"
    layers, _, kv_heads, dim = k_cache.shape
    pairs = src_slots.numel()
    if pairs == 0:
        return
    width = kv_heads * dim
    block = min(1024, tk.triton.next_power_of_2(width))
    tk.compact_kernel[(layers, -(-width // block))](
        k_cache, v_cache, src_slots, dst_slots, pairs, k_cache.stride(0), k_cache.stride(1),
        width, BLOCK=block)
