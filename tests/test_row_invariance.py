"""`verifier.exact`: a row's bits do not depend on the rows beside it, so speculation gives
exactly the served target's own plain decoding, in every dtype it serves (native int4, bf16,
float32).

Plain decoding runs a request's rows one at a time; a verify step runs a tree's rows at once,
its branches' nodes between a row and its ancestors; a batch pads every request to its longest
context. Checked at three levels: the attention (a tree row == the same row decoded alone,
beside longer and shorter segments), the served target's logits (the greedy path inside a
branching tree == one-row steps), and the mesh (speculative == plain greedy output)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from test_kernels import indptr, mask_from_parents, random_parents
from test_lean_target import chain, tree
from specmesh_kernels.backend import select_attention_backend
from specmesh_kernels.tree_attention import tree_attention_exact
from specmesh_kernels.linear_rules import native_supports
from specmesh_services.common.config import PLAIN_DECODING
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.server import load_target


def ancestors(parents: list[int], i: int) -> list[int]:
    """Node i's path from the root, itself last."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen1.5b"])
def test_attention_rows_equal_the_same_rows_decoded_alone(dtype, heads):
    """Each row of random trees (after prefixes of 3..700 positions, next to other segments)
    gives the bits of a one-row segment over its own prefix + ancestors, decoded alone."""
    h, kvh, d = heads
    g = torch.Generator().manual_seed(7)
    prefixes, sizes = [3, 700, 41, 128], [9, 1, 16, 5]
    parents = [random_parents(n, g) for n in sizes]
    kv_lens = [p + n for p, n in zip(prefixes, sizes)]
    num_slots = sum(kv_lens) + 5
    slots = torch.randperm(num_slots, generator=g)[:sum(kv_lens)]
    k_cache, v_cache = (torch.randn(num_slots, kvh, d, generator=g).to(dtype) for _ in "kv")
    q = torch.randn(sum(sizes), h, d, generator=g).to(dtype)
    masks = [mask_from_parents(p).reshape(-1) for p in parents]
    batch = tree_attention_exact(q, k_cache, v_cache, indptr(sizes), indptr(kv_lens), slots,
                                 torch.cat(masks), indptr([n * n for n in sizes]), d ** -0.5)
    starts, rows = indptr(kv_lens).tolist(), indptr(sizes).tolist()
    for s, (prefix, n) in enumerate(zip(prefixes, sizes)):
        own = slots[starts[s]:starts[s + 1]]
        for i in range(n):
            seen = torch.cat([own[:prefix], own[prefix + torch.tensor(ancestors(parents[s], i))]])
            alone = tree_attention_exact(q[rows[s] + i:rows[s] + i + 1], k_cache, v_cache,
                                         indptr([1]), indptr([len(seen)]), seen,
                                         torch.ones(1, dtype=torch.bool), indptr([1]), d ** -0.5)
            assert torch.equal(alone[0], batch[rows[s] + i]), f"segment {s}, row {i}"


SERVED = {"native": {}, "bf16": {"target_weights": "float"}, "float32": {"dtype": "float32"}}


@pytest.mark.slow
@pytest.mark.parametrize("served", SERVED)
def test_greedy_path_in_a_tree_equals_one_row_steps(served, base_settings, chat_prompt_ids):
    """The served target's logits of the greedy path's rows inside a branching tree (siblings
    between a row and its ancestors) are bit-identical to plain one-row steps."""
    settings = base_settings.with_overrides(**{"dtype": "auto", "target_weights": "auto",
                                               "verifier.exact": True, **SERVED[served]})
    if served == "native" and native_supports() is not None:
        pytest.skip(f"no native target here: {native_supports()}")
    target = load_target(settings)
    prompt = chat_prompt_ids(2)
    n = len(prompt)

    def engine() -> VerifierEngine:
        e = VerifierEngine(target, limits=EngineLimits(kv_budget_tokens=1024),
                           backend=select_attention_backend("cpu", exact=True))
        assert e.store.reserve("a", n + 16)
        first = e.target.forward([chain("a", prompt, 0, True)])[0][-1]
        e.store.set_length("a", n)
        return e, int(first.argmax())

    e, token = engine()
    path, plain = [token], []
    for i in range(5):
        logits = e.target.forward([chain("a", [path[-1]], n + i, True)])[0][0]
        e.store.set_length("a", n + i + 1)
        plain.append(logits)
        path.append(int(logits.argmax()))
    e, _ = engine()
    tokens = [path[0], 11, path[1], 12, 13, path[2], 14, path[3], path[4], 15]
    parents = [-1, 0, 0, 2, 2, 2, 5, 5, 7, 7]
    out = e.target.forward([tree("a", tokens, parents, n)])[0]
    for depth, row in enumerate([0, 2, 5, 7, 8]):
        assert torch.equal(out[row], plain[depth]), f"{served}: depth {depth}"


@pytest.mark.slow
def test_serving_defaults_equal_plain_decoding(base_settings, compute, questions):
    """The serving defaults (native target where it runs, the default model's datastore trees)
    with `verifier.exact` give exactly the output of plain decoding through the same mesh."""
    from specmesh_services.launch.embedded import EmbeddedMesh

    served = base_settings.with_overrides(**{"dtype": "auto", "speculation.source": "auto",
                                             "speculation.tree_size": "fixed",
                                             "verifier.exact": True})

    async def outputs(settings) -> tuple[list[list[int]], int]:
        async with EmbeddedMesh.start(settings, compute) as mesh:
            got, drafted = [], 0
            for i in range(4):
                messages = [{"role": "user", "content": questions[i]["turns"][0]}]
                out = await mesh.generate(messages=messages, max_tokens=48)
                got.append(list(out.token_ids))
                drafted += out.stats.draft_tokens
            return got, drafted

    speculative, drafted = asyncio.run(outputs(served))
    plain, _ = asyncio.run(outputs(served.with_overrides(**PLAIN_DECODING)))
    assert drafted > 0, "the serving defaults drafted nothing"
    assert speculative == plain
