"""Early pruning in the verifier (ProPD 4.1; services/verifier/prune.py) on the real default
model in float32 through the lean forward, with an untrained early head after layer 4 (the
logit lens: it prunes plenty at a small Top-k). The survivors' logits are the unpruned pass's
rows and every survivor's parent survives; greedy outputs of a batch with pruning equal
`generate`; at temperature 1 the first emitted token below pruned trees follows the target's
softmax; early heads train from extracted layer states, load for their model only, and the
mesh serves the shipped one."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.common.tree import TokenTree
from specmesh_services.heads import early, extract
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.prune import EarlyPruner
from specmesh_services.verifier.server import load_target
from test_batch_verify import binned, run_batch, state
from test_heads import CONVERSATIONS

LAYER, TOP_K = 4, 8


@pytest.fixture(scope="module")
def lean(base_settings):
    target = load_target(base_settings)
    assert isinstance(target, LeanDecoder)
    return target


@pytest.fixture(scope="module")
def lens(hf_target):
    """An untrained early head over all tokens: the final norm and LM head (tied to the
    embeddings) on layer 4."""
    head = early.EarlyHead(LAYER, hf_target.model.embed_tokens.weight.detach(),
                           hf_target.model.norm.weight.detach(), hf_target.config.rms_norm_eps,
                           torch.arange(hf_target.config.vocab_size))
    return head


def engine_with(lean, lens, top_k=TOP_K, pruned=True):
    engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=8192,
                                                      max_batch_tokens=8192))
    if pruned:
        engine.target.pruner = EarlyPruner(lens, top_k, weights=None)
    return engine


def lens_ranking(hf_target, lens, prompt: list[int]) -> list[int]:
    """The early head's ranking of the tokens after `prompt` (from transformers' layer 4)."""
    with torch.inference_mode():
        states = hf_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        return lens.logits(states[LAYER][0, -1:])[0].argsort(descending=True).tolist()


def test_survivors_keep_their_logits_and_their_ancestors(lean, lens, hf_target, chat_prompt_ids):
    prompt = chat_prompt_ids(2)
    ranked = lens_ranking(hf_target, lens, prompt)
    # two tokens in the early head's Top-k, one far out of it with a child: pruned with it
    tree = TokenTree((ranked[0], ranked[1], ranked[-1], 11, 913, 42),
                     (-1, -1, -1, 0, 2, 1))
    out = {}
    for pruned in (False, True):
        engine = engine_with(lean, lens, pruned=pruned)
        engine.load(state("r", prompt), [])
        plan = engine._plan("r", tree, 8192, [], True)  # the prompt's prefill, then the tree
        logits = engine.target.forward([plan.segment])[0]
        out[pruned] = (logits, engine.target.survivors[0], plan.compiled)
    full, _, compiled = out[False]
    logits, kept, _ = out[True]
    assert kept is not None and {0, 1, 2}.issubset(kept.tolist()), "root and Top-k kept"
    assert not {3, 5}.intersection(kept.tolist()), "the unlikely node and its child pruned"
    rows = set(kept.tolist())
    assert all(int(compiled.parents[r]) in rows for r in kept.tolist()[1:])
    torch.testing.assert_close(logits, full[kept], atol=1e-4, rtol=0)


def test_greedy_batch_with_pruning_equals_generate(lean, lens, chat_prompt_ids,
                                                   hf_greedy_reference):
    prompts = {f"q{i}": chat_prompt_ids(i) for i in range(4)}
    references = {f"q{i}": hf_greedy_reference[i] for i in range(4)}
    engine = engine_with(lean, lens)
    outputs, _ = run_batch(engine, prompts, references, "prune")
    pruner = engine.target.pruner
    assert pruner.pruned > 0.1 * pruner.nodes, (pruner.pruned, pruner.nodes)
    for rid in prompts:
        assert outputs[rid] == references[rid], rid
    assert engine.store.used_blocks == 0


def test_first_token_below_pruned_trees_follows_the_target_softmax(lean, lens, target_lm,
                                                                   hf_target, chat_prompt_ids):
    hot = SamplingParams(temperature=1.0)
    prompt = chat_prompt_ids(3)
    logits = target_lm.prefill(target_lm.new_cache(), prompt)
    probs = torch.softmax(logits, dim=-1)
    ranked = torch.argsort(probs, descending=True).tolist()
    early_ranked = lens_ranking(hf_target, lens, prompt)
    # the target's likeliest tokens and the early head's least likely one with a child below
    # it: that branch is pruned every time
    tree = TokenTree((ranked[0], ranked[1], early_ranked[-1], ranked[0], ranked[2]),
                     (-1, -1, -1, 2, -1))
    engine = engine_with(lean, lens, top_k=2)
    rounds, per = 120, 4
    counts = torch.zeros_like(probs)
    for r in range(rounds):
        items = []
        for j in range(per):
            engine.load(state(f"s{j}", prompt, hot, seed=r * per + j), [])
            items.append((f"s{j}", tree))
        for result in engine.step(items):
            w = result.outcome.walk
            counts[(w.tokens or [w.bonus])[0]] += 1
    assert engine.target.pruner.pruned >= 2 * rounds * per, "every tree loses a branch"
    obs, exp = binned(counts, probs * rounds * per)
    assert chisquare(obs, exp).pvalue > 0.001


def test_early_heads_train_on_layer_states_and_load_for_their_model(base_settings, tmp_path,
                                                                    hf_target):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS * 10))
    hidden = tmp_path / "hidden"
    meta = extract.extract(base_settings, None, str(corpus), hidden, seq_len=16, batch_size=4,
                           progress=False, layers=(2,))
    assert meta["layers"] == [2]
    shard = extract.load_shard(hidden, meta["shards"][0])
    ids = shard["tokens"][:16].long()[None]
    with torch.inference_mode():
        states = hf_target(ids, output_hidden_states=True).hidden_states[2][0]
    torch.testing.assert_close(shard["layer-2"][:16].float(), states, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="no states of layer 4"):
        early.train_early(base_settings, hidden, tmp_path / "e4", 4, progress=False)
    result = early.train_early(base_settings, hidden, tmp_path / "e2", 2, vocab=512,
                               progress=False)
    assert result["layer"] == 2 and result["vocab"] >= 512 and result["tokens_seen"] > 100
    assert set(result["recall"]) == set(early.RECALL_AT)
    assert all(0 <= r <= 1 for r in result["recall"].values())
    head_w = hf_target.model.embed_tokens.weight.detach()
    norm = hf_target.model.norm.weight.detach()
    head = early.load(tmp_path / "e2", base_settings.model, result["tokenizer"], head_w, norm,
                      1e-5)
    assert head.layer == 2 and head.vocab.numel() == result["vocab"]
    with pytest.raises(early.EarlyHeadMismatch, match="model"):
        early.load(tmp_path / "e2", "qwen2.5-coder-0.5b", result["tokenizer"], head_w, norm, 1e-5)


def test_mesh_with_the_shipped_early_head_equals_generate(base_settings, questions,
                                                          hf_greedy_reference, compute):
    from specmesh_services.launch.embedded import EmbeddedMesh
    from test_lossless_greedy import assert_target_tokens, generate_all

    settings = base_settings.with_overrides(drafters=["heads"], **{
        "speculation.max_nodes": 8, "verifier.prune": "on", "verifier.prune_top_k": 4})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            pruner = mesh.worker.engine.target.pruner
            assert pruner is not None and pruner.layer >= 1
            responses = await generate_all(mesh, questions[:4], concurrency=4)
            return responses, pruner.nodes, pruner.pruned
    responses, nodes, pruned = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference)
    assert nodes > 0 and pruned > 0, (nodes, pruned)
