"""Lossless sampling on the real model: at temperature 1 on a fixed context, the first emitted
token follows the target's softmax (chi-square), when the drafted token is the target's likeliest
and when it is unlikely; and the engine's verify makes exactly the walk's draws."""
import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.sampling import Sampler, SamplingParams
from specmesh_services.common.tree import TokenTree, compile_tree
from specmesh_services.verifier.engine import VerifierEngine
from specmesh_services.verifier.walk import walk
from specmesh.v1 import pool_pb2

SEEDS = 3000
HOT = SamplingParams(temperature=1.0)


def tree_logits(lm, prompt, tree):
    """Target logits of root + tree rows, computed the way the verifier does."""
    cache = lm.new_cache()
    lm.prefill(cache, prompt[:-1])
    compiled = compile_tree(tree, prompt[-1])
    root = len(prompt) - 1
    visible = torch.cat([torch.ones(compiled.num_rows, root, dtype=torch.bool),
                         compiled.ancestors], dim=1)
    return compiled, lm.forward(cache, compiled.tokens, root + compiled.depths, visible)


def binned(counts, expected, min_expected=5.0):
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    return obs.numpy(), exp.numpy()


@pytest.mark.parametrize("guess", ["right", "wrong"])
def test_first_token_distribution_matches_target_softmax(target_lm, chat_prompt_ids, guess):
    prompt = chat_prompt_ids(3)
    probs = torch.softmax(tree_logits(target_lm, prompt, TokenTree())[1][0], dim=-1)
    ranked = torch.argsort(probs, descending=True)
    drafted = int(ranked[0]) if guess == "right" else int(ranked[40])
    # a two-level draft: drafted token, then its own likeliest continuation
    compiled, logits = tree_logits(target_lm, prompt, TokenTree.chain([drafted]))
    second = int(logits[1].argmax())
    compiled, logits = tree_logits(target_lm, prompt, TokenTree.chain([drafted, second]))
    counts = torch.zeros_like(probs)
    for seed in range(SEEDS):
        result = walk(compiled, logits, Sampler(HOT, seed, len(prompt)), list(prompt))
        counts[result.tokens[0] if result.tokens else result.bonus] += 1
    obs, exp = binned(counts, probs * SEEDS)
    assert chisquare(obs, exp).pvalue > 0.01
    accepted_share = counts[drafted] / SEEDS
    assert abs(accepted_share - probs[drafted]) < 0.05


def test_engine_verify_makes_the_walks_draws(target_lm, chat_prompt_ids):
    prompt = chat_prompt_ids(3)
    tree = TokenTree(tokens=(11, 22, 33), parents=(-1, -1, 0))
    compiled, logits = tree_logits(target_lm, prompt, tree)
    engine = VerifierEngine(target_lm)
    for seed in range(20):
        state = pool_pb2.RequestState(request_id="s", prompt_ids=prompt, sampling=HOT.to_pb(),
                                      seed=seed)
        engine.load(state, [])
        outcome = engine.verify("s", tree)
        expected = walk(compiled, logits, Sampler(HOT, seed, len(prompt)), list(prompt))
        assert (outcome.walk.tokens, outcome.walk.bonus) == (expected.tokens, expected.bonus)
