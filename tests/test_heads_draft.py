"""Draft heads as a drafter (services/heads/draft.py, the verifier's heads): the sequential
trees against a loop over single nodes, batching changes no tree, heads of another model are
refused, how the router names them; and on the real default model in float32 with the heads
shipped for it: greedy output equal to the target's own, the heads' trees used, and the first
token sampled below a heads tree following the target's softmax (chi-square)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.drafts import router_drafters, serves_drafter
from specmesh_services.common.sampling import Sampler, SamplingParams
from specmesh_services.common.tree import TokenTree
from specmesh_services.heads.draft import (FRONTIER, WIDTH, HeadsDrafter, HeadsMismatch,
                                            load_for_target)
from specmesh_services.heads.model import GroundedHeads
from specmesh_services.verifier.walk import walk
from test_lossless_greedy import assert_target_tokens, generate_all  # noqa: E402
from test_lossless_sampling import binned, tree_logits  # noqa: E402

HIDDEN, VOCAB = 8, 40


def tiny_heads(num_heads=3, seed=0, vocab=None) -> GroundedHeads:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    heads = GroundedHeads(HIDDEN, num_heads, embed, torch.randn(VOCAB, HIDDEN, generator=gen),
                          vocab=vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return heads


@torch.no_grad()
def reference_tree(heads: GroundedHeads, f: torch.Tensor, bonus: int, limit: int) -> TokenTree:
    """The heads' tree built one node at a time: each frontier node's WIDTH likeliest
    tokens, the FRONTIER best-scored candidates of a level expanded (at most `limit` levels),
    the `limit` best kept."""
    nodes = []  # (path, score, parent index)
    frontier = [((), 1.0, -1)]
    for k in range(1, min(heads.num_heads, limit) + 1):
        level = []
        for path, score, index in frontier:
            logits = heads.logits(k, f[None], torch.tensor([[bonus, *path]]))[0]
            probs = logits.softmax(-1)
            for col in probs.topk(WIDTH).indices.tolist():
                nodes.append(((*path, int(heads.vocab[col])), score * float(probs[col]), index))
                level.append((nodes[-1][0], nodes[-1][1], len(nodes) - 1))
        frontier = sorted(level, key=lambda n: -n[1])[:FRONTIER]
    keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], i))[:limit])
    index = {old: new for new, old in enumerate(keep)}
    return TokenTree(tuple(nodes[i][0][-1] for i in keep),
                     tuple(-1 if nodes[i][2] < 0 else index[nodes[i][2]] for i in keep))


@pytest.mark.parametrize("vocab", [None, torch.tensor([0, 3, 5, 7, 11, 12, 20, 33, 39])])
def test_trees_are_the_node_by_node_construction_batched_or_not(vocab):
    heads = tiny_heads(vocab=vocab)
    drafter = HeadsDrafter(heads, {}, weights=None)  # float32: the reference's numbers
    f = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    bonus, limits = [4, 9, 4, 5], [8, 0, 30, 2]
    batched = drafter.draft(f, bonus, limits)
    for i, tree in enumerate(batched):
        alone = drafter.draft(f[i:i + 1], bonus[i:i + 1], limits[i:i + 1])[0]
        ref = reference_tree(heads, f[i], bonus[i], limits[i]) if limits[i] else TokenTree()
        assert (tree.tokens, tree.parents) == (alone.tokens, alone.parents)
        assert (tree.tokens, tree.parents) == (ref.tokens, ref.parents)
        levels = min(3, limits[i])
        assert len(tree) == (min(limits[i], WIDTH + (levels - 1) * FRONTIER * WIDTH)
                             if levels else 0)
        # scores: a path's product, never above its parent's; the source is the heads
        assert all(tree.scores[j] <= (1.0 if p < 0 else tree.scores[p])
                   for j, p in enumerate(tree.parents))
        assert not tree or tree.source_names == ("heads",)
        if vocab is not None:
            assert set(tree.tokens) <= set(vocab.tolist())
    assert max(batched[2].depths()) == 3 and max(batched[3].depths()) <= 2


def test_heads_of_another_model_are_refused(tmp_path):
    heads = tiny_heads(2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in heads.state_dict().items()},
              str(tmp_path / "heads.safetensors"))
    meta = {"model": "smollm2-135m", "tokenizer": "abc", "hidden_size": HIDDEN, "num_heads": 2}
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    embed, lm_head = heads.embed, torch.randn(VOCAB, HIDDEN)
    loaded = HeadsDrafter.load(tmp_path, "smollm2-135m", "abc", embed, lm_head, weights=None)
    assert loaded.depth == 2
    with pytest.raises(HeadsMismatch, match="model 'smollm2-135m', the target has 'qwen"):
        HeadsDrafter.load(tmp_path, "qwen2.5-coder-1.5b", "abc", embed, lm_head)
    with pytest.raises(HeadsMismatch, match="hidden_size"):
        HeadsDrafter.load(tmp_path, "smollm2-135m", "abc", torch.zeros(VOCAB, 4), lm_head)
    with pytest.raises(FileNotFoundError, match="specmesh heads train"):
        HeadsDrafter.load(tmp_path / "none", "smollm2-135m", "abc", embed, lm_head)


def test_the_router_takes_the_heads_as_one_more_drafter(base_settings):
    def drafters(*specs):
        return base_settings.with_overrides(drafters=list(specs))
    assert router_drafters(drafters(), None) == ("", None)  # the default draft
    assert router_drafters(drafters("heads"), None) == ("heads", ["heads"])
    assert router_drafters(drafters("heads", "layers:8"), None) == ("heads", ["", "heads"])
    assert router_drafters(drafters("layers:8", "heads:/x"), ["a"]) == ("", ["a", "heads"])
    with pytest.raises(ValueError, match="at most one heads"):
        router_drafters(drafters("heads", "heads:/x"), None)
    assert not serves_drafter(base_settings.with_overrides(drafters=["heads"]))
    assert serves_drafter(base_settings.with_overrides(drafters=["heads", "layers:8"]))
    assert serves_drafter(base_settings)  # the default draft
    assert not serves_drafter(base_settings.with_overrides(**{"speculation.source":
                                                              "datastore"}))


# the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heads_settings(base_settings):
    return base_settings.with_overrides(drafters=["heads"], **{"speculation.max_nodes": 8})


def test_greedy_with_the_shipped_heads_equals_target_generate(heads_settings, questions,
                                                              hf_greedy_reference, compute):
    from specmesh_services.launch.embedded import EmbeddedMesh

    async def run():
        async with EmbeddedMesh.start(heads_settings, compute) as mesh:
            assert mesh.drafter is None and mesh.worker.engine.heads is not None
            return await generate_all(mesh, questions[:8], concurrency=4)
    responses = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    steps = sum(r.stats.steps for r in responses)
    assert drafted > 0 and accepted > 0.2 * steps, (drafted, accepted, steps)


def test_first_token_below_a_heads_tree_follows_the_target_softmax(heads_settings, target_lm,
                                                                   chat_prompt_ids):
    drafter = load_for_target(heads_settings, "heads")
    prompt = chat_prompt_ids(3)
    # the target's greedy token after the prompt, and the heads' tree below it
    compiled, logits = tree_logits(target_lm, prompt, TokenTree())
    bonus = int(logits[0].argmax())
    context = [*prompt, bonus]
    hidden = target_lm.model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
    tree = drafter.draft(hidden[None], [bonus], [8])[0]
    assert len(tree) == 8
    compiled, logits = tree_logits(target_lm, context, tree)
    probs = torch.softmax(logits[0], dim=-1)
    counts = torch.zeros_like(probs)
    for seed in range(3000):
        result = walk(compiled, logits, Sampler(SamplingParams(temperature=1.0), seed),
                      context)
        counts[(result.tokens or [result.bonus])[0]] += 1
    obs, exp = binned(counts, probs * 3000)
    assert chisquare(obs, exp).pvalue > 0.001
