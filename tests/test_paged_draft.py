"""services/drafter/paged.py: a draft model's forward over the paged store, bucketed as on a GPU
(there replayed from CUDA graphs), against the lean forward over per-request buffers (the
reference): the same logits and KV rows for a prefill, a chain and a tree level whose rows see
only their ancestors; the same trees through batched drafts, rollbacks, pending tokens and a
prefill longer than the largest bucket; blocks returned on release; a full store refused.
Its Triton attention runs in the interpreter here; tests/test_cuda.py replays the graphs."""
from __future__ import annotations

import os

import pytest
import torch

from specmesh_services.common.rpc import Overloaded
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.lean import LeanLM
from specmesh_services.drafter.paged import PagedLM
from test_lean_draft import tiny_qwen2  # tests/ is on the path

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU Triton runs only under TRITON_INTERPRET=1 (conftest)")

ATOL = 1e-4


def paged(capacity: int = 2048, max_rows: int = 64, device: str = "cpu") -> PagedLM:
    """tiny_qwen2 over a paged store: eager on the CPU, graphs captured at first use on CUDA."""
    return PagedLM(tiny_qwen2().to(device), "paged", capacity, max_rows)


def test_paged_forwards_equal_the_lean_forwards():
    """A prefill past the 64-row bucket (eager), a chain after it, then two tree levels (the
    second one's rows see the root and one node of the first level each; replayed): logits
    and every layer's K/V as the lean forward's."""
    lean, page = LeanLM(tiny_qwen2(), "lean"), paged()
    a, b = lean.new_cache(), page.new_cache()
    prompt = list(range(7, 107))
    torch.testing.assert_close(page.prefill(b, prompt[:-3]), lean.prefill(a, prompt[:-3]),
                               atol=ATOL, rtol=0)
    chain = torch.tensor(prompt[-3:])
    torch.testing.assert_close(page.forward(b, chain), lean.forward(a, chain), atol=ATOL, rtol=0)
    past = len(a)
    first = torch.zeros(2, past + 2, dtype=torch.bool)
    first[:, :past] = True
    first[[0, 1], [past, past + 1]] = True
    level = torch.tensor([5, 9])
    torch.testing.assert_close(page.forward(b, level, torch.full((2,), past), first),
                               lean.forward(a, level, torch.full((2,), past), first),
                               atol=ATOL, rtol=0)
    second = torch.zeros(3, past + 5, dtype=torch.bool)
    second[:, :past] = True
    second[[0, 1, 2], [past + 1, past, past + 1]] = True  # parents: node 1, node 0, node 1
    second[[0, 1, 2], [past + 2, past + 3, past + 4]] = True
    level = torch.tensor([11, 3, 250])
    torch.testing.assert_close(page.forward(b, level, torch.full((3,), past + 1), second),
                               lean.forward(a, level, torch.full((3,), past + 1), second),
                               atol=ATOL, rtol=0)
    assert page.graphs.last_bucket == 4, "the level ran through the bucketed step"
    assert len(a) == len(b) == past + 5
    for (k, v), (rk, rv) in zip(b.tensors(), a.tensors()):
        torch.testing.assert_close(k, rk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ATOL, rtol=0)


PROMPTS = {"a": list(range(3, 40)), "b": [(7 * i) % 300 for i in range(150)], "c": [42]}


def rounds(draft: DraftModel) -> list[tuple[int, ...]]:
    """Three requests drafted together, four rounds of top-k trees: the first node accepted,
    then a bonus the draft missed ("a": a token more, a pending row before the next root); "b"
    prefilled past a 64-row bucket (its prefill runs eagerly), "c" prefilled again in the third
    round."""
    out = []
    for rid, prompt in PROMPTS.items():
        draft.prefill(rid, prompt)
    new = {rid: [] for rid in PROMPTS}
    for round_ in range(4):
        if round_ == 2:
            draft.prefill("c", [42, 43, 44])
            new["c"] = []
        jobs = [(rid, new[rid], 3, 3) for rid in PROMPTS]
        for rid, (tree, _) in zip(PROMPTS, draft.draft_many(jobs)):
            out.append(tree.tokens)
            first = tree.tokens[0]
            new[rid] = [first, (first + 17) % 300] + ([(first + 5) % 300] if rid == "a" else [])
    return out


def test_paged_drafts_the_lean_trees_through_rollbacks_and_batches():
    """`rounds` through both forwards: the same trees, and every block back in the store once
    the requests are released."""
    lean = DraftModel(LeanLM(tiny_qwen2(), "d"), "d", "model")
    page = DraftModel(paged(max_rows=64), "d", "model")
    assert rounds(page) == rounds(lean)
    store = page.lm.store
    assert store.used_blocks > 0
    for rid in PROMPTS:
        assert page.release(rid)
    assert store.used_blocks == 0 and not store.seqs


def test_a_full_draft_store_is_refused_as_overloaded():
    draft = DraftModel(paged(capacity=64), "d", "model")
    draft.prefill("a", list(range(1, 50)))
    with pytest.raises(Overloaded, match="the draft KV store is full"):
        draft.prefill("b", list(range(1, 50)))
    draft.release("a")
    draft.prefill("b", list(range(1, 50)))  # its blocks are free again


def test_a_bucket_smaller_than_a_tree_level_is_refused():
    with pytest.raises(ValueError, match="must hold a tree level"):
        paged(max_rows=32)
