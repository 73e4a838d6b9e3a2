"""The lossless walk on literal logits: greedy paths, bonus tokens, and (chi-square) the
distribution of the first emitted token against the target's softmax."""
import pytest
import torch
from scipy.stats import chisquare

from services.common.sampling import Sampler, SamplingParams
from services.common.tree import TokenTree, compile_tree
from services.verifier.walk import walk

V = 8


def one_hot_logits(rows):
    """Logits whose argmax per row is the given token."""
    logits = torch.zeros(len(rows), V)
    for i, token in enumerate(rows):
        logits[i, token] = 5.0
    return logits


def test_greedy_walk_descends_the_matching_branch_and_emits_a_bonus():
    # root children: a=1 (row1), b=2 (row2); a's children: c=3 (row3), d=4 (row4)
    tree = compile_tree(TokenTree(tokens=(1, 2, 3, 4), parents=(-1, -1, 0, 0)), root_token=0)
    # target: after root -> 1, after a -> 4, after d -> 6 (not drafted: bonus)
    logits = one_hot_logits([1, 4, 0, 0, 6])  # rows: root, a, b, c, d
    result = walk(tree, logits, Sampler(SamplingParams(), 0), root_position=10)
    assert result.tokens == [1, 4] and result.rows == [1, 4] and result.nodes == [0, 3]
    assert result.bonus == 6


def test_greedy_walk_rejecting_at_the_root_emits_the_targets_token():
    tree = compile_tree(TokenTree.chain([1, 2]), root_token=0)
    result = walk(tree, one_hot_logits([5, 2, 3]), Sampler(SamplingParams(), 0), 0)
    assert result.tokens == [] and result.bonus == 5


def test_fully_accepted_chain_ends_with_the_leafs_sample():
    tree = compile_tree(TokenTree.chain([1, 2]), root_token=0)
    result = walk(tree, one_hot_logits([1, 2, 7]), Sampler(SamplingParams(), 0), 0)
    assert result.tokens == [1, 2] and result.bonus == 7


def first_token_counts(logits_root, drafted, seeds, temperature=1.0):
    tree = compile_tree(TokenTree.chain([drafted]), root_token=0)
    logits = torch.stack([logits_root, torch.zeros(V)])
    counts = torch.zeros(V)
    for seed in range(seeds):
        result = walk(tree, logits, Sampler(SamplingParams(temperature=temperature), seed), 3)
        first = result.tokens[0] if result.tokens else result.bonus
        counts[first] += 1
    return counts


@pytest.mark.parametrize("drafted", [3, 6], ids=["guess-right", "guess-wrong"])
def test_first_token_follows_the_target_softmax(drafted):
    logits = torch.tensor([0.0, 1.0, 0.5, 2.0, -1.0, 0.2, -3.0, 1.5])  # argmax 3, token 6 unlikely
    seeds = 4000
    counts = first_token_counts(logits, drafted, seeds)
    expected = torch.softmax(logits, 0) * seeds
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 0.01
