"""The row-parallel walk (every row drawn at once on the logits' device, then one copy to the
host) against the sequential walk on literal trees: the same accepted rows, tokens and bonus,
greedy and sampled, with penalties; and every row's draw is the sampler's own draw given that
row's path."""
import torch
from hypothesis import given, settings, strategies as st

from specmesh_services.common.sampling import Sampler, SamplingParams
from specmesh_services.common.tree import TokenTree, compile_tree
from specmesh_services.verifier.walk import row_draws, walk, walk_draws

VOCAB = 6  # few tokens: draws often match a child, so walks go deep


@st.composite
def cases(draw):
    n = draw(st.integers(1, 12))
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    tokens = tuple(draw(st.integers(0, VOCAB - 1)) for _ in range(n))
    committed = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    prompt_len = draw(st.integers(0, len(committed)))
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0, 1.5])),
        top_k=draw(st.sampled_from([0, 1, 3])), top_p=draw(st.sampled_from([1.0, 0.8])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.4])))
    seed = draw(st.integers(0, 2**32))
    logits_seed = draw(st.integers(0, 2**16))
    return TokenTree(tokens, parents), committed, prompt_len, params, seed, logits_seed


@settings(max_examples=300, deadline=None)
@given(cases())
def test_row_parallel_walk_equals_the_sequential_walk(case):
    tree, committed, prompt_len, params, seed, logits_seed = case
    compiled = compile_tree(tree, root_token=committed[-1])
    logits = torch.randn(compiled.num_rows, VOCAB,
                         generator=torch.Generator().manual_seed(logits_seed)) * 2
    sampler = Sampler(params, seed, prompt_len)

    draws = row_draws(compiled, logits, sampler, committed).tolist()
    assert walk_draws(compiled, draws) == walk(compiled, logits, sampler, committed)
    for row in range(compiled.num_rows):  # each row: the sampler's draw after its own path
        path = [int(compiled.tokens[j]) for j in range(1, row + 1) if compiled.ancestors[row, j]]
        depth = int(compiled.depths[row])
        assert draws[row] == sampler.sample(logits[row], len(committed) + depth,
                                            committed + path)
