"""Tests of kernels/: every implementation against the float32 reference on irregular, seeded
batches (prefixes 0/1/17/37/300, trees of 1/5/23 nodes from random parent arrays, GQA, shuffled
non-contiguous slots), plus identities: merged chunks == monolithic attention, a chain-shaped
tree == causal attention, in-order compaction. The Triton kernels run under TRITON_INTERPRET=1
(set by conftest.py before anything imports triton), so shapes stay small. With
CUDA_VISIBLE_DEVICES set (conftest.py then leaves TRITON_INTERPRET unset) and a GPU, every tensor
lives on CUDA and the kernels are compiled for it (tests/test_cuda.py adds realistic shapes);
with neither, the Triton cases skip.

Run: .venv/bin/pytest tests/test_kernels.py -q --durations=10
"""
from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest
import torch
import torch.nn.functional as F

from specmesh_kernels.backend import select_attention_backend
from specmesh_kernels.compaction import compact_kv_ref, compact_kv_torch, compact_kv_triton
from specmesh_kernels.decomposed import (decomposed_attention_ref, decomposed_attention_triton,
                                merge_states_ref, merge_states_triton, partial_attention_ref,
                                partial_attention_triton, plan_chunks)
from specmesh_kernels.metadata import TreeBatch
from specmesh_kernels.tree_attention import (segment_mask, tree_attention_ref, tree_attention_torch,
                                    tree_attention_triton)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# where the tests' tensors live: CUDA when there is one and Triton compiles for it, else the CPU
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")
TRITON_RUNS = INTERPRET or DEVICE.type == "cuda"
needs_triton = pytest.mark.skipif(not TRITON_RUNS,
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 (conftest.py)")


def impls(names) -> list:
    """Parametrize values: the names, the Triton ones marked needs_triton."""
    return [pytest.param(n, marks=needs_triton) if "triton" in n else n for n in names]


# ---------------------------------------------------------------------------------------------
# batches
def random_parents(n: int, g: torch.Generator) -> list[int]:
    """A valid topologically ordered parent array: node 0 is a child of the root (-1), node i's
    parent is a random earlier node or the root."""
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]


def mask_from_parents(parents: list[int]) -> torch.Tensor:
    """[n, n] bool ancestor mask: row i = own bit OR parent's row (EAGLE's runtime form)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_slots, KVH, D]
    v_cache: torch.Tensor  # [num_slots, KVH, D]
    qo_indptr: torch.Tensor  # [S + 1]
    kv_indptr: torch.Tensor  # [S + 1]
    kv_slots: torch.Tensor  # [sum kv_len]
    tree_mask: torch.Tensor  # [sum n^2] bool
    mask_indptr: torch.Tensor  # [S + 1]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.qo_indptr, self.kv_indptr, self.kv_slots,
                self.tree_mask, self.mask_indptr, self.scale)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) if f.name != "scale"
                       else self.scale for f in fields(self)))


def indptr(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0] + sizes).cumsum(0)


def make_batch(prefixes: list[int], trees: list[int], heads: int = 6, kv_heads: int = 2,
               dim: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0,
               chains: tuple[int, ...] = (), device: torch.device | str = DEVICE) -> Batch:
    """Segment s: prefixes[s] committed positions + trees[s] new rows (a random tree, or a
    causal chain if s in chains), its positions at shuffled slots of a larger cache; built on
    the CPU (seeded), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    masks = [torch.ones(n, n, dtype=torch.bool).tril() if s in chains
             else mask_from_parents(random_parents(n, g)) for s, n in enumerate(trees)]
    kv_lens = [p + n for p, n in zip(prefixes, trees)]
    num_slots = sum(kv_lens) + 11  # spare slots that nobody reads
    slots = torch.randperm(num_slots, generator=g)[:sum(kv_lens)]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return Batch(rand(sum(trees), heads, dim), rand(num_slots, kv_heads, dim),
                 rand(num_slots, kv_heads, dim), indptr(trees), indptr(kv_lens), slots,
                 torch.cat([m.reshape(-1) for m in masks]), indptr([n * n for n in trees]),
                 1.0 / math.sqrt(dim)).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-3,
                 what: str = "") -> None:
    """max |actual - expected| <= rel * max |expected|; prints max abs / rel difference."""
    a, e = actual.float(), expected.float()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in output"
    diff = (a - e).abs()
    max_abs, scale = diff.max().item(), e.abs().max().item()
    max_rel = (diff / e.abs().clamp_min(1e-6)).max().item()
    assert max_abs <= rel * scale, (f"{what}: max abs diff {max_abs:.3e}, max rel diff "
                                    f"{max_rel:.3e}, max |expected| {scale:.3e}, tol {rel}")


# ---------------------------------------------------------------------------------------------
# tree attention vs the reference
CASES = {  # name: (prefixes, trees, chain segments)
    "p1-t1": ([1], [1], ()),
    "p17-t5": ([17], [5], ()),
    "p0-t9": ([0], [9], ()),  # a lone tree without prefix
    "p300-t4": ([300], [4], ()),  # the largest lone step (LONE_ROWS)
    "p37-t23": ([37], [23], ()),
    "p300-t23": ([300], [23], ()),
    "mixed": ([1, 17, 37, 300], [5, 23, 1, 23], ()),
    "prefill+tree": ([0, 17, 37], [40, 5, 23], (0, 1)),  # chain from scratch, chain on prefix
    "decode": ([3, 300, 40, 1], [1, 1, 1, 1], ()),  # plain decoding steps: one row each
    "decode-same": ([40, 40, 40], [1, 1, 1], ()),  # ... of equal contexts: nothing masked
}
HEADS = {"gqa6-2": (6, 2), "mha4": (4, 4)}
ATTENTION = {"torch": tree_attention_torch, "triton": tree_attention_triton,
             # every segment of up to 64 rows through the padded batch (trees, chains, masks)
             "torch-padded": functools.partial(tree_attention_torch, small_rows=64, lone=False),
             "torch-sdpa": functools.partial(tree_attention_torch, lone=False)}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("impl", impls(ATTENTION))
def test_tree_attention_matches_reference(impl, case, heads):
    prefixes, trees, chains = case
    batch = make_batch(prefixes, trees, *heads, chains=chains, seed=len(trees) + heads[1])
    expected = tree_attention_ref(*batch.args())
    assert_close(ATTENTION[impl](*batch.args()), expected, what=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["torch", "torch-padded", "torch-sdpa", "torch-exact"])
@pytest.mark.parametrize("case", [([300], [1]), ([37], [23]), ([0], [40]), ([17, 3], [1, 5])],
                         ids=["decode", "tree", "prefill", "two"])
def test_consecutive_slots_read_as_views_give_the_gathered_bits(impl, case, dtype):
    """A segment whose positions lie in consecutive slots (a lone request's blocks) reads K/V as
    a slice of the cache (`TreeBatch.kv_start`; a lone one-row step by `_lone_row`); the same
    rows at shuffled slots are gathered first. Both are the same products: bit for bit the same
    output."""
    batch = make_batch(*case, seed=5, dtype=dtype).to("cpu")
    # the same K/V rows at slots 0 .. n - 1 in position order
    sequential = Batch(batch.q, batch.k_cache[batch.kv_slots], batch.v_cache[batch.kv_slots],
                       batch.qo_indptr, batch.kv_indptr, torch.arange(batch.kv_slots.numel()),
                       batch.tree_mask, batch.mask_indptr, batch.scale)
    meta = TreeBatch.build(*sequential.args()[3:8])
    assert [meta.kv_start(s) for s in range(meta.num_segments)] == list(meta.kv[:-1])
    assert TreeBatch.build(*batch.args()[3:8]).kv_start(0) is None
    attention = {**ATTENTION, "torch-exact": functools.partial(tree_attention_torch,
                                                               exact=True)}[impl]
    assert torch.equal(attention(*sequential.args()), attention(*batch.args()))


@needs_triton
def test_triton_irregular_head_dim_and_meta_reuse():
    """D = 24 (not a power of two) and one TreeBatch shared by two calls (two 'layers')."""
    batch = make_batch([37, 3], [5, 7], heads=4, kv_heads=1, dim=24, seed=3)
    meta = TreeBatch.build(*batch.args()[3:8])
    expected = tree_attention_ref(*batch.args())
    for _ in range(2):
        assert_close(tree_attention_triton(*batch.args(), meta=meta), expected, what="triton")
        assert_close(tree_attention_torch(*batch.args(), meta=meta), expected, what="torch")


@pytest.mark.parametrize("impl", impls(ATTENTION))
def test_bf16_matches_float32_reference(impl):
    batch = make_batch([37, 300, 0], [23, 5, 17], dtype=torch.bfloat16, chains=(2,), seed=4)
    out = ATTENTION[impl](*batch.args())
    assert out.dtype == torch.bfloat16
    assert_close(out, tree_attention_ref(*batch.args()), rel=2e-2, what=f"{impl} bf16")


@pytest.mark.parametrize("impl", impls(["ref", *ATTENTION]))
@pytest.mark.parametrize("prefix", [0, 17, 37])
def test_chain_equals_causal_attention(impl, prefix):
    """A chain-shaped tree after a prefix == SDPA is_causal over prefix + chain (its last rows)."""
    n, heads, kv_heads, dim = 9, 6, 2, 32
    batch = make_batch([prefix], [n], heads, kv_heads, dim, chains=(0,), seed=prefix)
    g = torch.Generator().manual_seed(7)
    q_full = torch.randn(prefix + n, heads, dim, generator=g).to(DEVICE)  # [P + n, H, D]
    batch.q = q_full[prefix:].contiguous()
    k = batch.k_cache[batch.kv_slots].transpose(0, 1)[None]  # [1, KVH, P + n, D]
    v = batch.v_cache[batch.kv_slots].transpose(0, 1)[None]
    causal = F.scaled_dot_product_attention(q_full.transpose(0, 1)[None], k, v, is_causal=True,
                                            scale=batch.scale, enable_gqa=True)
    impls = {"ref": tree_attention_ref, **ATTENTION}
    assert_close(impls[impl](*batch.args()), causal[0].transpose(0, 1)[prefix:], what=impl)


# ---------------------------------------------------------------------------------------------
# decomposed attention
def reference_lse(batch: Batch) -> torch.Tensor:
    """[T, H] natural-log LSE of each row's whole visible KV."""
    meta = TreeBatch.build(*batch.args()[3:8])
    out = []
    for s in range(meta.num_segments):
        slots = meta.kv_slots[meta.kv[s]:meta.kv[s + 1]]
        rows = batch.q[meta.qo[s]:meta.qo[s + 1]]
        out.append(partial_attention_ref(rows, batch.k_cache[slots], batch.v_cache[slots],
                                         segment_mask(meta, s), batch.scale)[1])
    return torch.cat(out)


DECOMPOSED = {"ref": decomposed_attention_ref, "triton": decomposed_attention_triton}
CHUNKS = {  # chunk size: batch (prefixes, trees); chunk 1 stays small (one item per position)
    1: ([17, 1, 4], [5, 1, 9]),
    7: ([17, 1, 37], [5, 1, 23]),
    64: ([300, 37, 0], [23, 5, 17]),
    10_000: ([300, 37, 1], [23, 5, 1]),
}


@pytest.mark.parametrize("chunk", CHUNKS.keys())
@pytest.mark.parametrize("impl", impls(DECOMPOSED))
def test_merged_chunks_equal_monolithic(impl, chunk):
    prefixes, trees = CHUNKS[chunk]
    batch = make_batch(prefixes, trees, seed=chunk)
    out, lse = DECOMPOSED[impl](*batch.args(), chunk)
    assert_close(out, tree_attention_ref(*batch.args()), what=f"{impl} o, chunk {chunk}")
    assert_close(lse, reference_lse(batch), what=f"{impl} lse, chunk {chunk}")


@needs_triton
def test_fully_masked_chunk_gives_minus_inf_and_zero():
    """Chunks of 1 position over a tree: a row that cannot see that node gets s = -inf, v = 0."""
    batch = make_batch([3], [6], seed=5)
    meta = TreeBatch.build(*batch.args()[3:8])
    ranges = [(0, lo, lo + 1, lo) for lo in range(meta.kv_len(0))]
    v, s = partial_attention_triton(batch.q, batch.k_cache, batch.v_cache, meta, ranges,
                                    len(ranges), batch.scale, "per-position")
    hidden = ~segment_mask(meta, 0)  # [n, kv_len]: True where the row sees nothing
    assert hidden.any(), "the test tree should hide some nodes from some rows"
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    assert torch.equal(torch.isneginf(s), hidden[:, :, None].expand_as(s))
    assert torch.all(v[hidden] == 0)
    merged, lse = merge_states_triton(v, s)
    assert_close(merged, tree_attention_ref(*batch.args()), what="merged per-position")
    assert_close(lse, reference_lse(batch), what="lse per-position")


@needs_triton
def test_merge_states_triton_matches_reference():
    g = torch.Generator().manual_seed(11)
    v = torch.randn(13, 5, 3, 24, generator=g)  # [T, C, H, D]
    s = torch.randn(13, 5, 3, generator=g) * 4  # [T, C, H]
    s[0] = float("-inf")  # a row with no state at all
    s[1, 1:] = float("-inf")  # a row with one state
    s[torch.rand(13, 5, 3, generator=g) < 0.3] = float("-inf")
    v, s = v.to(DEVICE), s.to(DEVICE)
    v_ref, s_ref = merge_states_ref(v, s)
    v_tri, s_tri = merge_states_triton(v, s)
    assert torch.all(v_tri[0] == 0) and torch.all(torch.isneginf(s_tri[0]))
    assert torch.equal(torch.isneginf(s_tri), torch.isneginf(s_ref))
    finite = ~torch.isneginf(s_ref)
    assert_close(v_tri, v_ref, what="merged v")
    assert_close(s_tri[finite], s_ref[finite], what="merged s")


@pytest.mark.parametrize("kv_lens,chunk", [([1, 17, 37, 300], 7), ([2000, 3, 64], 512),
                                           ([5, 0, 9], 1), ([10], 10_000)])
def test_plan_chunks_covers_each_segment_in_balanced_chunks(kv_lens, chunk):
    items = plan_chunks(kv_lens, chunk)
    for s, kv_len in enumerate(kv_lens):
        mine = [(lo, hi) for seg, lo, hi in items if seg == s]
        assert len(mine) == -(-kv_len // chunk)
        if kv_len == 0:
            assert not mine
            continue
        assert [lo for lo, _ in mine] == [0] + [hi for _, hi in mine[:-1]]  # contiguous
        assert mine[-1][1] == kv_len
        sizes = [hi - lo for lo, hi in mine]
        assert all(0 < size <= chunk for size in sizes)
        assert max(sizes) - min(sizes) <= 1  # balanced, no short tail chunk


# ---------------------------------------------------------------------------------------------
# compaction
def make_caches(dtype=torch.float32, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 20, 2, 8)  # [L, num_slots, KVH, D]
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def accepted_path_moves(keep: list[int], base: int, seed: int) -> tuple[torch.Tensor, ...]:
    """KVStore.commit's pairs for rows at positions base + keep[i] -> base + i, through a
    shuffled position -> slot map."""
    slot_of = torch.randperm(20, generator=torch.Generator().manual_seed(seed))
    moves = [(base + r, base + i) for i, r in enumerate(keep) if r != i]
    src = slot_of[[m[0] for m in moves]]
    dst = slot_of[[m[1] for m in moves]]
    return src.to(DEVICE), dst.to(DEVICE)


COMPACT = {"torch": compact_kv_torch, "triton": compact_kv_triton}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keep", [[0, 2, 3], [0, 1, 4, 6, 7], [3]], ids=str)
@pytest.mark.parametrize("impl", impls(COMPACT))
def test_compaction_matches_reference_and_gather(impl, keep, dtype):
    src, dst = accepted_path_moves(keep, base=5, seed=len(keep))
    k, v = make_caches(dtype)
    k_old, v_old = k.clone(), v.clone()
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_ref(k_ref, v_ref, src, dst)
    COMPACT[impl](k, v, src, dst)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    k_gather, v_gather = k_old.clone(), v_old.clone()  # a fresh gather of the old rows
    k_gather[:, dst], v_gather[:, dst] = k_old[:, src], v_old[:, src]
    assert torch.equal(k, k_gather) and torch.equal(v, v_gather)


@needs_triton
def test_compaction_triton_runs_pairs_in_order():
    """Pair 1 reads the slot pair 0 wrote: in-order semantics give slot 2 = old slot 1."""
    src, dst = torch.tensor([1, 0, 5], device=DEVICE), torch.tensor([0, 2, 1], device=DEVICE)
    k, v = make_caches(seed=1)
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_ref(k_ref, v_ref, src, dst)
    compact_kv_triton(k, v, src, dst)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(k[:, 2], k_ref[:, 0])


# ---------------------------------------------------------------------------------------------
# backend selection
def test_backend_on_cpu_is_torch(caplog):
    with caplog.at_level(logging.INFO, logger="specmesh_kernels.backend"):
        backend = select_attention_backend(torch.device("cpu"))
    assert backend.name == "torch"
    assert "attention backend: torch (cpu)" in caplog.text
    batch = make_batch([17, 37], [5, 23], seed=9, device="cpu")
    expected = tree_attention_ref(*batch.args())
    for _ in range(2):  # the second call reuses the first call's TreeBatch
        assert_close(backend.attend(*batch.args()), expected, what="torch backend")
    assert backend.attend._last[0][0] is batch.qo_indptr


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest.py)")
def test_backend_triton_under_interpreter():
    backend = select_attention_backend("cpu", "triton")
    assert backend.name == "triton"
    batch = make_batch([17, 0], [5, 6], seed=10, chains=(1,))
    assert_close(backend.attend(*batch.args()), tree_attention_ref(*batch.args()), what="triton")
    src, dst = accepted_path_moves([0, 2, 3], base=4, seed=2)
    k, v = make_caches()
    k_ref, v_ref = k.clone(), v.clone()
    compact_kv_ref(k_ref, v_ref, src, dst)
    backend.compact(k, v, src, dst)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@needs_triton
def test_backend_triton_splits_long_prefixes():
    """A segment longer than min_kv (and the chunk size) takes the split-KV path; same result."""
    from specmesh_kernels.backend import tree_attention_split

    batch = make_batch([300, 1, 37], [5, 1, 23], seed=12)
    expected = tree_attention_ref(*batch.args())
    # 64: decomposed (300 + 5 > 64); the defaults: one tree-attention launch (305 <= min_kv)
    for kwargs in ({"chunk_size": 64, "min_kv": 64}, {}):
        assert_close(tree_attention_split(*batch.args(), **kwargs), expected,
                     what=f"split {kwargs}")


def test_backend_rejects_bad_preferences(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("cpu", "cudnn")
    with pytest.raises(ValueError, match="needs CUDA"):
        select_attention_backend("cpu", "flash-attn")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention_backend("cpu", "triton")


def test_torch_backend_never_imports_triton():
    code = ("import sys, torch; from specmesh_kernels.backend import select_attention_backend as s; "
            "b = s('cpu'); q = torch.randn(2, 2, 8); k = torch.randn(4, 2, 8); "
            "b.attend(q, k, k, torch.tensor([0, 2]), torch.tensor([0, 3]), torch.tensor([0, 1, 2]),"
            " torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]), 0.3); "
            "b.compact(k[None], k[None], torch.tensor([1]), torch.tensor([0])); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
