"""KV store (block allocation, budget, in-place compaction) and the verify-cost regression, on
literal inputs (no model)."""
from __future__ import annotations

import random

import pytest
import torch

from specmesh_services.common.kv import KVStore
from specmesh_services.verifier.cost import VerifyCostModel


def make_store(capacity: int = 64, block: int = 4) -> KVStore:
    return KVStore(num_layers=2, kv_heads=1, head_dim=3, capacity_tokens=capacity,
                   block_size=block, dtype=torch.float32)


def fill(store: KVStore, request_id: str, start: int, end: int) -> None:
    """Writes value = position into positions start..end-1 of every layer."""
    slots = store.slots(request_id, start, end)
    pos = torch.arange(start, end, dtype=torch.float32)[:, None, None].expand(-1, 1, 3)
    for layer in range(store.k.shape[0]):
        store.k[layer, slots] = pos + 1000 * layer
        store.v[layer, slots] = -pos - 1000 * layer


def rows(store: KVStore, request_id: str) -> torch.Tensor:
    """Position value held at each committed position of layer 0."""
    return store.k[0, store.slots(request_id, 0, store.length(request_id)), 0, 0]


def test_reserve_within_budget_and_refusal_takes_nothing():
    store = make_store(capacity=16, block=4)  # 4 blocks
    assert store.reserve("a", 9)  # 3 blocks
    assert store.used_blocks == 3
    assert not store.reserve("b", 5)  # needs 2, 1 free
    assert store.used_blocks == 3 and "b" not in store.seqs
    assert store.reserve("b", 4)
    assert store.free("a") == 3 and store.used_blocks == 1


def test_slots_follow_blocks_in_order():
    store = make_store(capacity=16, block=4)
    store.reserve("a", 4)
    store.reserve("b", 4)
    store.reserve("a", 6)  # a's second block comes after b's
    assert store.slots("a", 0, 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert store.slots("b", 0, 4).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 3], [0, 3, 5, 6], [0, 1, 7]])
def test_commit_gathers_accepted_rows_in_place(keep):
    store = make_store(capacity=64, block=4)
    base = 5  # committed prefix rows 0..4; a step wrote root + 7 tree rows at 5..12
    store.reserve("a", base + 8)
    fill(store, "a", 0, base + 8)
    store.commit("a", base, keep)
    expected = list(range(base)) + [base + r for r in keep]
    assert rows(store, "a").tolist() == expected
    slots = store.slots("a", 0, store.length("a"))
    assert store.v[1, slots, 0, 0].tolist() == [-p - 1000 for p in expected]
    assert store.length("a") == base + len(keep)
    assert len(store.seqs["a"].blocks) == store.blocks_for(base + len(keep))  # tail freed


def test_commit_with_injected_compaction_kernel():
    calls = []

    def compact(k, v, src, dst):
        calls.append((src.tolist(), dst.tolist()))
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]

    store = KVStore(2, 1, 3, 32, 4, torch.float32, compact=compact)
    store.reserve("a", 8)
    fill(store, "a", 0, 8)
    store.commit("a", 2, [0, 2, 3])
    assert calls == [([4, 5], [3, 4])]  # only the rows that move
    assert rows(store, "a").tolist() == [0, 1, 2, 4, 5]


def test_many_requests_interleaved_keep_their_rows():
    rng = random.Random(0)
    store = make_store(capacity=256, block=4)
    model: dict[str, list[int]] = {}
    for step in range(60):
        rid = f"r{rng.randrange(6)}"
        length = store.length(rid)
        new = rng.randint(1, 6)
        if not store.reserve(rid, length + new):
            store.free(rid)
            model.pop(rid, None)
            continue
        fill(store, rid, length, length + new)
        keep = sorted(rng.sample(range(1, new), rng.randint(0, new - 1))) if new > 1 else []
        store.commit(rid, length, [0, *keep])
        model[rid] = model.get(rid, []) + [length + r for r in [0, *keep]]
        # a request's row values are the positions they were written at
        assert rows(store, rid).tolist() == model[rid]
    for rid, expected in model.items():
        assert rows(store, rid).tolist() == expected


def test_budget_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="smaller than one block"):
        make_store(capacity=3, block=4)


def test_cost_model_recovers_a_linear_cost():
    model = VerifyCostModel(decay=1.0)
    rng = random.Random(1)
    assert model.fit() is None
    for _ in range(200):
        rows, segments = rng.randint(1, 512), rng.randint(1, 8)
        context = rows + segments * rng.randint(16, 2000)
        seconds = 0.02 + 1e-4 * rows + 2e-6 * context + 1e-3 * segments
        model.observe(rows, context, segments, seconds * (1 + rng.uniform(-0.01, 0.01)))
    fit = model.fit()
    assert fit.intercept_s == pytest.approx(0.02, rel=0.1)
    assert fit.per_row_s == pytest.approx(1e-4, rel=0.05)
    assert fit.per_context_s == pytest.approx(2e-6, rel=0.1)
    assert model.predict(64, 1000, 4) == pytest.approx(0.02 + 64e-4 + 2e-3 + 4e-3, rel=0.03)


def test_cost_model_follows_recent_steps():
    model = VerifyCostModel(decay=0.9)
    for i in range(100):
        model.observe(8 + i % 8, 100, 1, 0.05)
    for i in range(100):
        model.observe(8 + i % 8, 100, 1, 0.10)  # the machine got slower
    assert model.predict(12, 100, 1) == pytest.approx(0.10, rel=0.02)
