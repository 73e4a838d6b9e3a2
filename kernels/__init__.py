"""specmesh kernels: pure compute over torch tensors (torch and triton, no services).

Attention over the verifier's packed, ragged tree batches (a call's layout: backend.py,
`AttentionBackend`): tree_attention.py, decomposed.py (split-KV), compaction.py (accepting a
tree path), metadata.py (`TreeBatch`, built once per forward), backend.py (the one place
choosing torch / triton / flash-attn); triton_kernels.py holds the @triton.jit kernels, imported
lazily (the CPU serving path never imports triton); aot_check.py compiles them for CUDA without
a GPU. CPU linear layers: onednn.py, fp16.py, int8.py, int4.py, row_stable.py, one kind each;
linear_rules.py decides which a model's weights become, from the probes of cpu_probe.py.
"""
