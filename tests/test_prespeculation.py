"""Pre-speculation: the next tree drafted while a step is verified, under "the whole main path
accepted". The drafter's rollback of an outcome that did not come true (`DraftItem.context_len`)
leaves it drafting exactly what a drafter prefilled with the real context drafts (SmolLM2
fp32); the subtree below the real bonus is the next tree; and the mesh's greedy output with
pre-speculation on is the target's own, at batch 1 and 8."""
import asyncio

import pytest

from specmesh_services.common.tree import TokenTree
from specmesh_services.drafter.engine import DraftJob, DraftModel
from specmesh_services.launch.embedded import EmbeddedMesh

from test_lossless_greedy import assert_target_tokens, messages

DEPTH = 4
TOKENS = 32  # of the 64-token references


def test_subtree_continues_the_node_with_its_descendants_in_order():
    tree = TokenTree((5, 6, 7, 8, 9, 10), (-1, 0, 0, 1, -1, 3), (0.9, 0.8, 0.7, 0.6, 0.5, 0.4),
                     (0, 0, 1, 0, 1, 0), ("a", "b"))
    below = tree.subtree(0)
    assert below.tokens == (6, 7, 8, 10) and below.parents == (-1, -1, 0, 2)
    assert below.scores == (0.8, 0.7, 0.6, 0.4) and below.sources == (0, 1, 0, 0)
    assert tree.subtree(4) == TokenTree(source_names=("a", "b"))


def fresh_tree(lm, tokens: list[int]) -> tuple[int, ...]:
    model = DraftModel(lm, "fresh", "model")
    model.prefill("r", tokens)
    return model.draft("r", [], DEPTH, 1)[0].tokens


@pytest.mark.parametrize("outcome", ["miss", "path-then-other-bonus", "hit", "prefix"])
def test_a_drafter_rolls_back_what_it_drafted_ahead(target_lm, chat_prompt_ids, outcome):
    prompt = chat_prompt_ids(1)
    model = DraftModel(target_lm, "draft", "model")
    model.prefill("r", prompt)
    path = list(model.draft("r", [], DEPTH, 1)[0].tokens)
    # ahead: the whole path committed, the next tree below its last token (first level: bonus)
    ahead = model.draft_many([DraftJob("r", path, DEPTH + 1, 1, 0.0, len(prompt))])[0][0]
    guess = ahead.tokens[0]
    if outcome == "hit":  # the path accepted, the bonus guessed: told the bonus only
        real, call = path + [guess], DraftJob("r", [guess], DEPTH, 1, 0.0, len(prompt) + DEPTH)
    elif outcome == "path-then-other-bonus":
        other = (guess + 1) % target_lm.vocab_size
        real, call = path + [other], DraftJob("r", [other], DEPTH, 1, 0.0, len(prompt) + DEPTH)
    elif outcome == "miss":  # two accepted, then the target's own token
        other = (path[2] + 1) % target_lm.vocab_size
        real = path[:2] + [other]
        call = DraftJob("r", real, DEPTH, 1, 0.0, len(prompt))
    else:  # the bonus is the path's third token: the real tokens stop inside the path
        real, call = path[:3], DraftJob("r", path[:3], DEPTH, 1, 0.0, len(prompt))
    got = model.draft_many([call])[0][0].tokens
    assert model.requests["r"].tokens == prompt + real
    assert got == fresh_tree(target_lm, prompt + real)


def test_a_call_past_the_tokens_a_drafter_holds_is_refused(target_lm):
    model = DraftModel(target_lm, "draft", "model")
    model.prefill("r", [1, 2, 3])
    with pytest.raises(ValueError, match="prefill it again"):
        model.draft_many([DraftJob("r", [4], DEPTH, 1, 0.0, 5)])


@pytest.mark.parametrize("concurrency,draft,placement", [(1, "layers:30", "split"),
                                                         (8, "layers:20", "shared")])
def test_greedy_output_with_prespeculation_is_the_targets(base_settings, questions,
                                                          hf_greedy_reference, compute,
                                                          concurrency, draft, placement):
    """The full-depth draft (the target itself) alone, drafting on a core of its own beside
    the verifier, and a shallower one with 8 in flight: trees drafted ahead are used (hits) or
    rolled back (misses); the output is the target's."""
    settings = base_settings.with_overrides(drafters=[draft], cores=placement, **{
        "speculation.depth": 3, "speculation.prespeculate": True,
        "verifier.batch_size": concurrency})
    gate = asyncio.Semaphore(concurrency)

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            async def one(q):
                async with gate:
                    return await mesh.generate(messages=messages(q), max_tokens=TOKENS)
            return await asyncio.gather(*(one(q) for q in questions[:8]))

    responses = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference, TOKENS)
    kinds = [[d.prespeculation for d in r.stats.decisions] for r in responses]
    flat = [k for ks in kinds for k in ks]
    # the target's own draft is mostly right ahead, the shallow one mostly rolled back
    assert flat.count("hit" if draft == "layers:30" else "miss") > 0, kinds
