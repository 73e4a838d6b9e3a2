"""The lossless walk on literal logits: greedy paths, bonus tokens, (chi-square) the
distribution of the first emitted token against the target's softmax, and penalties computed on
the path-extended history (committed tokens + the accepted path above each row)."""
import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.sampling import Sampler, SamplingParams, apply_penalties, probabilities
from specmesh_services.common.tree import TokenTree, compile_tree
from specmesh_services.verifier.walk import walk

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
    result = walk(tree, logits, Sampler(SamplingParams(), 0), [7] * 10 + [0])
    assert result.tokens == [1, 4] and result.rows == [1, 4] and result.nodes == [0, 3]
    assert result.bonus == 6


def test_greedy_walk_rejecting_at_the_root_emits_the_targets_token():
    tree = compile_tree(TokenTree.chain([1, 2]), root_token=0)
    result = walk(tree, one_hot_logits([5, 2, 3]), Sampler(SamplingParams(), 0), [0])
    assert result.tokens == [] and result.bonus == 5


def test_fully_accepted_chain_ends_with_the_leafs_sample():
    tree = compile_tree(TokenTree.chain([1, 2]), root_token=0)
    result = walk(tree, one_hot_logits([1, 2, 7]), Sampler(SamplingParams(), 0), [0])
    assert result.tokens == [1, 2] and result.bonus == 7


def first_token_counts(logits_root, drafted, seeds, temperature=1.0):
    tree = compile_tree(TokenTree.chain([drafted]), root_token=0)
    logits = torch.stack([logits_root, torch.zeros(V)])
    counts = torch.zeros(V)
    for seed in range(seeds):
        result = walk(tree, logits, Sampler(SamplingParams(temperature=temperature), seed),
                      [5, 5, 5, 0])
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


# ---------------------------------------------------------------------------------------------
# penalties: the history of a row is the committed tokens + the accepted path above it

# root(0) -> a=1 (row 1) -> {1 (row 2), 2 (row 3)}; after a the target prefers 1 (3.0) over 2 (2.5)
BRANCH = TokenTree(tokens=(1, 1, 2), parents=(-1, 0, 0))
BRANCH_LOGITS = torch.tensor([
    [0.0, 5.0, 0, 0, 0, 0, 0, 0],  # root: a=1
    [0.0, 3.0, 2.5, 0, 0, 0, 0, 0],  # after a: 1, unless 1 is penalized
    [0.0, 0, 0, 0, 0, 0, 6.0, 0],  # after a, 1: bonus 6
    [0.0, 0, 0, 0, 0, 0, 0, 6.0],  # after a, 2: bonus 7
])


def sequential(logits_by_path, sampler, tokens, steps):
    """Reference: the target decoding alone, one position at a time, with its full history."""
    seq = list(tokens)
    for _ in range(steps):
        seq.append(sampler.sample(logits_by_path(seq[len(tokens):]), len(seq), seq))
    return seq[len(tokens):]


def branch_row(path):
    rows = {(): 0, (1,): 1, (1, 1): 2, (1, 2): 3}
    return BRANCH_LOGITS[rows[tuple(path)]]


def test_without_penalty_the_likeliest_child_is_accepted():
    tree = compile_tree(BRANCH, root_token=0)
    result = walk(tree, BRANCH_LOGITS, Sampler(SamplingParams(), 0), [4, 0])
    assert result.tokens == [1, 1] and result.bonus == 6


def test_repetition_penalty_sees_the_accepted_path():
    # a=1 was just accepted: with penalty 1.5 token 1 drops to 2.0 < 2.5, so the walk takes 2.
    # (Penalizing with the committed tokens alone, which lack 1, would take 1.)
    tree = compile_tree(BRANCH, root_token=0)
    sampler = Sampler(SamplingParams(repetition_penalty=1.5), 0, prompt_len=2)
    result = walk(tree, BRANCH_LOGITS, sampler, [4, 0])
    assert result.tokens == [1, 2] and result.rows == [1, 3] and result.bonus == 7
    assert [*result.tokens, result.bonus] == sequential(branch_row, sampler, [4, 0], 3)


def test_repetition_penalty_sees_the_committed_tokens():
    # 2 is already in the prompt as well: both penalized, 3.0/1.5 > 2.5/1.5, back to 1.
    tree = compile_tree(BRANCH, root_token=0)
    sampler = Sampler(SamplingParams(repetition_penalty=1.5), 0, prompt_len=3)
    result = walk(tree, BRANCH_LOGITS, sampler, [2, 4, 0])
    assert result.tokens == [1, 1] and result.bonus == 6
    assert [*result.tokens, result.bonus] == sequential(branch_row, sampler, [2, 4, 0], 3)


@pytest.mark.parametrize("tokens,prompt_len,expected", [
    ([4, 5, 0], 1, [1, 2]),  # only the path's 1 is penalized: 2.4 < 2.5
    ([2, 5, 0], 1, [1, 2]),  # 2 is in the prompt: not counted, still 2.4 < 2.5
    ([4, 2, 0], 1, [1, 1]),  # 2 was generated: 2.4 > 1.9
    ([4, 2, 2, 2, 0], 1, [1, 1]),  # presence counts once however often
])
def test_presence_penalty_counts_generated_tokens_and_the_path(tokens, prompt_len, expected):
    tree = compile_tree(BRANCH, root_token=0)
    sampler = Sampler(SamplingParams(presence_penalty=0.6), 0, prompt_len=prompt_len)
    result = walk(tree, BRANCH_LOGITS, sampler, tokens)
    assert result.tokens == expected
    assert [*result.tokens, result.bonus] == sequential(branch_row, sampler, tokens, 3)


def test_frequency_penalty_counts_generated_committed_tokens_and_the_path():
    tree = compile_tree(BRANCH, root_token=0)
    params = SamplingParams(frequency_penalty=0.2)
    # committed: prompt [4] + generated [2, 2, 0]. After a: 1 -> 3.0 - 0.2 = 2.8, 2 -> 2.5 - 0.4
    # = 2.1: the walk takes 1.
    assert walk(tree, BRANCH_LOGITS, Sampler(params, 0, prompt_len=1), [4, 2, 2, 0]).tokens == [1, 1]
    # the same 1s in the prompt do not count: committed prompt [1, 1, 1, 1] + generated [0];
    # after a only the path's 1 counts (2.8 > 2.5): 1. With prompt_len=0 they would (2.0): 2.
    assert walk(tree, BRANCH_LOGITS, Sampler(params, 0, prompt_len=4), [1, 1, 1, 1, 0]).tokens \
        == [1, 1]
    assert walk(tree, BRANCH_LOGITS, Sampler(params, 0, prompt_len=0), [1, 1, 1, 1, 0]).tokens \
        == [1, 2]


def test_second_token_follows_the_penalized_softmax_of_the_path():
    """Temperature 1, repetition + frequency penalties: given the drafted first token was
    accepted, the next emitted token is distributed as the softmax of the row's logits penalized
    with committed tokens + that first token (chi-square)."""
    tokens, prompt_len, drafted = [3, 5, 0], 1, 1
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8, frequency_penalty=0.5)
    root = torch.tensor([0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # mostly accepts drafted=1
    after = torch.tensor([0.5, 1.5, 0.2, 1.0, -0.5, 1.2, 0.0, 0.8])
    tree = compile_tree(TokenTree.chain([drafted, 3]), root_token=0)
    logits = torch.stack([root, after, torch.zeros(V)])
    counts, accepted = torch.zeros(V), 0
    for seed in range(4000):
        result = walk(tree, logits, Sampler(params, seed, prompt_len), tokens)
        if result.tokens[:1] == [drafted]:
            accepted += 1
            counts[result.tokens[1] if len(result.tokens) > 1 else result.bonus] += 1
    assert accepted > 3000
    want = probabilities(apply_penalties(after, [*tokens, drafted], prompt_len, params), params)
    assert chisquare(counts.numpy(), (want * accepted).numpy()).pvalue > 0.01
    plain = torch.softmax(after, 0)
    assert (want[1] - plain[1]).abs() > 0.1  # the penalty really moved the distribution
