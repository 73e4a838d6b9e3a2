"""Coupled drafting: a sampled request's drafter ranks its distribution by the target's own race
(same seed, same position), and the verifier's walk is unchanged. On small bigram models
(DraftModel over a table-lookup LM), at temperature 0.7 and 1 with top-k and top-p on, for a
right draft (the target's own table) and a wrong one, on chains and trees:
- the emitted tokens are exactly plain sampling's with the same seed (the draft never changes
  the output);
- the first two emitted tokens follow the target's processed distributions (chi-square);
- a right draft is accepted whole, and a wrong one at least as often as the uncoupled rule
  (its likeliest token, accepted with the target's probability of it) would be.
"""
import asyncio

import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.config import PLAIN_DECODING
from specmesh_services.common.sampling import Sampler, SamplingParams, probabilities
from specmesh_services.common.tree import compile_tree
from specmesh_services.drafter.engine import Coupling, DraftModel
from specmesh_services.verifier.walk import walk

VOCAB = 16
SEEDS = 1000
PROMPT = [3, 7, 1]
SETTINGS = [SamplingParams(temperature=0.7, top_k=10, top_p=0.9),
            SamplingParams(temperature=1.0, top_k=12, top_p=0.95)]


class _Rows:
    """The fake LM's cache: the tokens whose rows it holds."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def keep(self, start: int, rows) -> None:
        self.tokens = self.tokens[:start] + [self.tokens[r] for r in rows]

    def truncate(self, length: int) -> None:
        del self.tokens[length:]


class BigramLM:
    """Next-token logits depend on the last token only: logits = table[token]."""

    num_layers = 1

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.vocab_size = table.shape[1]

    def new_cache(self) -> _Rows:
        return _Rows()

    def prefill(self, cache: _Rows, tokens) -> None:
        cache.tokens.extend(tokens)

    def forward_many(self, parts):
        out = []
        for part in parts:
            cache = part.cache
            cache.tokens.extend(part.tokens.tolist())
            out.append(self.table[part.tokens[part.logits_from:]])
        return out


def tables() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    target = 2.0 * torch.randn(VOCAB, VOCAB, generator=generator)
    wrong = target + 1.5 * torch.randn(VOCAB, VOCAB, generator=generator)
    return target, wrong


def plain(table: torch.Tensor, sampler: Sampler, n: int) -> list[int]:
    """Plain sampling: one token at a time with the same sampler."""
    tokens = list(PROMPT)
    for _ in range(n):
        tokens.append(sampler.sample(table[tokens[-1]], len(tokens)))
    return tokens[len(PROMPT):]


def verify(table: torch.Tensor, tree, sampler: Sampler) -> list[int]:
    compiled = compile_tree(tree, PROMPT[-1])
    result = walk(compiled, table[compiled.tokens], sampler, PROMPT)
    return [*result.tokens, result.bonus]


def draws(params: SamplingParams, guess: str, width: int):
    """Per seed: the emitted tokens below a coupled draft of depth 3 and its drafted count."""
    target, wrong = tables()
    drafter = DraftModel(BigramLM(target if guess == "right" else wrong), "bigram", "model")
    for seed in range(SEEDS):
        seeded = SamplingParams(**{**params.__dict__, "seed": seed})
        drafter.prefill("r", PROMPT, Coupling.of(seeded, VOCAB))
        tree, _ = drafter.draft("r", [], 3, width)
        sampler = Sampler(seeded, seed, len(PROMPT))
        yield seed, tree, verify(target, tree, sampler), sampler


def binned(counts: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0):
    """Cells with too few expected draws pooled into one (outside the support: never drawn)."""
    assert counts[expected == 0].sum() == 0, "a token outside the target's support was emitted"
    big = expected >= min_expected
    obs, exp = [counts[big]], [expected[big]]
    if expected[~big].sum() > 0:
        obs.append(counts[~big].sum().view(1))
        exp.append(expected[~big].sum().view(1))
    obs, exp = torch.cat(obs), torch.cat(exp)
    return obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("guess", ["right", "wrong"])
@pytest.mark.parametrize("params", SETTINGS, ids=["t0.7", "t1.0"])
def test_coupled_drafts_keep_the_targets_distribution(params, guess, width):
    target, _ = tables()
    first = torch.zeros(VOCAB)
    pairs = torch.zeros(VOCAB, VOCAB)
    for seed, tree, emitted, sampler in draws(params, guess, width):
        assert emitted == plain(target, Sampler(sampler.params, seed, len(PROMPT)), len(emitted))
        if len(emitted) >= 2:
            pairs[emitted[0], emitted[1]] += 1
        first[emitted[0]] += 1
    p1 = probabilities(target[PROMPT[-1]], params)
    assert chisquare(*binned(first, p1 * SEEDS)).pvalue > 0.001
    # the second token, given the first, follows the target's row of the first
    top = int(first.argmax())
    p2 = probabilities(target[top], params)
    row = pairs[top]
    assert chisquare(*binned(row, p2 * row.sum())).pvalue > 0.001


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.7", "t1.0"])
def test_a_right_draft_is_accepted_whole_and_a_wrong_one_beats_the_uncoupled_rule(params):
    target, wrong = tables()
    for _, tree, emitted, _ in draws(params, "right", 1):
        assert len(emitted) == len(tree) + 1  # every drafted token accepted, then the bonus
    accepted = 0
    for _, tree, emitted, _ in draws(params, "wrong", 1):
        accepted += tree.tokens[0] == emitted[0]
    # uncoupled: the draft's likeliest first token, accepted with the target's probability of it
    p = probabilities(target[PROMPT[-1]], params)
    uncoupled = float(p[int(probabilities(wrong[PROMPT[-1]], params).argmax())])
    assert accepted / SEEDS > uncoupled


def test_greedy_or_unseeded_requests_draft_the_likeliest_tokens():
    assert Coupling.of(SamplingParams(temperature=0.0, seed=1), VOCAB) is None
    assert Coupling.of(SamplingParams(temperature=1.0), VOCAB) is None
    with pytest.raises(ValueError, match="target_vocab_size"):
        Coupling.of(SamplingParams(temperature=1.0, seed=1), 0)
    with pytest.raises(ValueError, match="top_p"):
        Coupling.of(SamplingParams(temperature=1.0, seed=1, top_p=2.0), VOCAB)


def test_the_mesh_samples_the_same_tokens_with_any_draft_and_couples_its_drafts(
        base_settings, questions, compute):
    """SmolLM2 fp32 through the embedded mesh at temperature 1 with top-p and top-k, seeded:
    with coupled drafts (batch 1; 6 in flight with pre-speculation), uncoupled drafts and no
    speculation the outputs are identical, and coupled drafts are accepted more often than
    uncoupled ones."""
    from specmesh_services.launch.embedded import EmbeddedMesh

    draft = base_settings.with_overrides(drafters=["layers:20"], **{
        "speculation.depth": 4, "speculation.width": 1})
    runs = {"coupled": draft, "uncoupled": draft.with_overrides(**{"speculation.coupled": False}),
            "ahead": draft.with_overrides(**{"speculation.prespeculate": True}),
            "plain": base_settings.with_overrides(**PLAIN_DECODING)}
    sampling = dict(temperature=1.0, top_p=0.95, top_k=50, max_tokens=16)

    async def run(settings, concurrency):
        gate = asyncio.Semaphore(concurrency)
        async with EmbeddedMesh.start(settings.with_overrides(
                **{"verifier.batch_size": concurrency}), compute) as mesh:
            async def one(i):
                async with gate:
                    return await mesh.generate(messages=[{"role": "user", "content":
                                                          questions[i]["turns"][0]}],
                                               seed=i, **sampling)
            return await asyncio.gather(*(one(i) for i in range(6)))

    out = {(name, c): asyncio.run(run(runs[name], c))
           for name, c in (("plain", 1), ("coupled", 1), ("ahead", 6), ("uncoupled", 1))}
    reference = [list(r.token_ids) for r in out["plain", 1]]
    for key, responses in out.items():
        assert [list(r.token_ids) for r in responses] == reference, key
    share = {name: sum(r.stats.accepted_tokens for r in out[name, 1])
             / sum(r.stats.draft_tokens for r in out[name, 1]) for name in ("coupled", "uncoupled")}
    print(f"accepted share of drafted tokens: {share}")
    assert share["coupled"] > share["uncoupled"], share
