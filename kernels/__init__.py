"""specmesh attention kernels: pure compute over torch tensors (torch and triton, no services).

Where it sits: the verifier (services/verifier/packed.py) runs ONE forward of the target over a
packed, ragged batch of segments (one per request: a prefill chain and/or the root + tree
nodes). For every layer it writes the new rows' K/V into its slot-addressed KV store, then calls
`AttentionBackend.attend` (kernels/backend.py) with the layout below. After the tree walk it
calls `AttentionBackend.compact` to move the accepted path's rows to the end of the prefix.

Layout of one attention call (T new rows in total, S segments):
- q: [T, H, D] packed query rows; segment s owns rows qo_indptr[s] : qo_indptr[s + 1] (n_s).
- k_cache, v_cache: [num_slots, KVH, D], one layer's storage; H % KVH == 0 and query head h
  reads KV head h // (H // KVH) (GQA). The new rows' K/V are already in the cache.
- Segment s's positions 0 .. kv_len_s - 1 live at slots kv_slots[kv_indptr[s] : kv_indptr[s+1]]
  (any slots, not contiguous; kv_len_s >= n_s). The first kv_len_s - n_s positions are its
  committed prefix, seen by all its rows; the last n_s are its new rows, row i sees new row j iff
  tree_mask[mask_indptr[s] + i * n_s + j] (diagonal included; a chain is lower-triangular).
- scale: softmax scale. Output o: [T, H, D] in q's dtype, accumulated in float32.

Modules:
- metadata.py: `TreeBatch`, the index data converted once per forward.
- tree_attention.py: `tree_attention_ref` / `_torch` (CPU serving) / `_triton`.
- decomposed.py: split-KV (SPIN's request decomposition) with exact log-sum-exp merging.
- compaction.py: KV compaction (accepting a tree path) across all layers, in place.
- backend.py: `select_attention_backend`, the one place choosing torch / triton / flash-attn.
- triton_kernels.py: the @triton.jit kernels; imported lazily, so the CPU serving path never
  imports triton. Without a GPU they run under TRITON_INTERPRET=1 (set before importing triton).
"""
