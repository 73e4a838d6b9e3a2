"""KV rollback: after a partly rejected tree, the verifier's and the drafter's caches equal
caches built by prefilling the accepted sequence from scratch (fp32 tolerance)."""
import pytest
import torch

from specmesh_services.common.lm import CausalLM, Part
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.common.tree import TokenTree
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.verifier.engine import VerifierEngine
from specmesh.v1 import pool_pb2

ATOL = 1e-4


def assert_same_cache(lm: CausalLM, cache, tokens):
    """`cache` holds the same rows as a fresh prefill of `tokens`."""
    ref = lm.new_cache()
    lm.prefill(ref, tokens)
    assert len(cache) == len(tokens)
    for layer, ((k, v), (rk, rv)) in enumerate(zip(cache.tensors(), ref.tensors())):
        assert k.shape == rk.shape, f"layer {layer}: {tuple(k.shape)} vs {tuple(rk.shape)}"
        assert torch.allclose(k, rk, atol=ATOL), f"layer {layer} keys differ by {(k - rk).abs().max()}"
        assert torch.allclose(v, rv, atol=ATOL), f"layer {layer} values differ by {(v - rv).abs().max()}"


class StoreView:
    """A request's rows in the verifier's KV store, shaped like a DynamicCache's tensors."""

    def __init__(self, engine: VerifierEngine, request_id: str) -> None:
        self.store, self.request_id = engine.store, request_id

    def __len__(self) -> int:
        return self.store.length(self.request_id)

    def tensors(self):
        slots = self.store.slots(self.request_id, 0, len(self))
        return [(self.store.k[layer, slots].transpose(0, 1)[None],
                 self.store.v[layer, slots].transpose(0, 1)[None])
                for layer in range(self.store.k.shape[0])]


def greedy(lm: CausalLM, tokens, n):
    cache = lm.new_cache()
    logits = lm.prefill(cache, tokens)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = lm.prefill(cache, [out[-1]])
    return out


def test_verifier_cache_after_partly_rejected_tree(target_lm, chat_prompt_ids):
    prompt = chat_prompt_ids(0)
    g1, g2, g3 = greedy(target_lm, prompt, 3)
    wrong = (g3 + 1) % target_lm.vocab_size
    other = (g1 + 7) % target_lm.vocab_size
    # root -> g1 -> g2 -> wrong ; root -> other ; g1 -> other
    tree = TokenTree(tokens=(g1, other, g2, other, wrong), parents=(-1, -1, 0, 0, 2))
    engine = VerifierEngine(target_lm)
    state = pool_pb2.RequestState(request_id="r", prompt_ids=prompt,
                                  sampling=SamplingParams().to_pb(), seed=0)
    engine.load(state, [])
    outcome = engine.verify("r", tree)
    assert outcome.walk.tokens == [g1, g2] and outcome.walk.bonus == g3
    assert outcome.walk.nodes == [0, 2]
    tokens = engine.requests["r"].tokens
    assert tokens == prompt + [g1, g2, g3]
    assert_same_cache(target_lm, StoreView(engine, "r"), tokens[:-1])


@pytest.fixture(scope="module", params=["transformers", "lean"])
def draft(target_path, request):
    """A 20-layer draft of the target, run by transformers' forward and by the drafter's lean
    decoder loop (services/drafter/lean.py): every drafter test holds for both."""
    from specmesh_kernels.linear_rules import pack_linears
    from specmesh_services.common import models
    from specmesh_services.drafter.lean import LeanLM

    if request.param == "transformers":
        lm = CausalLM(models.load_model(target_path, torch.float32, num_layers=20), "d")
    else:
        model = models.load_model(target_path, torch.float32, num_layers=20, linear="torch")
        lm = LeanLM(model, "d", prepare=pack_linears)
    return DraftModel(lm, "d", "truncated")


@pytest.mark.parametrize("accept_depth", [0, 1, 2, 3], ids=lambda d: f"accept{d}")
def test_drafter_cache_after_partly_rejected_tree(draft, chat_prompt_ids, accept_depth):
    prompt = chat_prompt_ids(1)
    draft.prefill("q", prompt)
    tree, _ = draft.draft("q", [], depth=3, width=2)
    assert len(tree) == 6 and tree.depths() == [1, 1, 2, 2, 3, 3]
    # accept the path to the first node at `accept_depth` (leaf level 3 has no rows yet)
    path = tree.path_to(tree.depths().index(accept_depth)) if accept_depth else []
    accepted = [tree.tokens[i] for i in path]
    children = {t for t, p in zip(tree.tokens, tree.parents) if p == (path[-1] if path else -1)}
    bonus = next(t for t in range(100, 200) if t not in children)  # a token the drafter missed
    draft.draft("q", accepted + [bonus], depth=0, width=1)
    state = draft.requests["q"]
    assert state.tokens == prompt + accepted + [bonus]
    assert_same_cache(draft.lm, state.cache, state.tokens[:-1])


def test_drafter_chain_continues_correctly_after_rollback(draft, chat_prompt_ids):
    """After a rollback the next draft equals one drafted from a fresh prefill."""
    prompt = chat_prompt_ids(2)
    draft.prefill("a", prompt)
    tree, _ = draft.draft("a", [], depth=4, width=1)
    new = [tree.tokens[0], 123]
    continued, _ = draft.draft("a", new, depth=4, width=1)
    draft.prefill("b", prompt + new)
    fresh, _ = draft.draft("b", [], depth=4, width=1)
    assert continued.tokens == fresh.tokens


def test_prefill_computes_only_the_last_rows_logits(target_lm, chat_prompt_ids):
    """`last=1` (what `prefill` asks) gives the full forward's last row, and the cache is the
    same: only the LM head is skipped for the other rows."""
    ids = chat_prompt_ids(0)
    full_cache, short_cache = target_lm.new_cache(), target_lm.new_cache()
    full = target_lm.forward(full_cache, torch.tensor(ids))
    short = target_lm.forward(short_cache, torch.tensor(ids), last=1)
    assert short.shape == (1, full.shape[1])
    torch.testing.assert_close(short[0], full[-1])
    torch.testing.assert_close(target_lm.prefill(target_lm.new_cache(), ids), full[-1])
    for (k1, v1), (k2, v2) in zip(full_cache.tensors(), short_cache.tensors()):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_forward_many_equals_one_forward_per_request(draft, chat_prompt_ids):
    """Several requests' rows in one forward (chains from empty and after a cache, a single
    row, tree rows under a visibility mask, a chain without logits) give each request the
    logits and cache rows of its own forward."""
    lm = draft.lm
    prompts = [chat_prompt_ids(i)[:40] for i in (3, 4, 5, 6)]
    solo = [lm.new_cache() for _ in prompts]
    many = [lm.new_cache() for _ in prompts]
    for i in (1, 2, 3):  # request 0 starts empty, the others after a past
        lm.prefill(solo[i], prompts[i][:-4])
        lm.prefill(many[i], prompts[i][:-4])
    past = len(solo[2])
    visible = torch.zeros(3, past + 3, dtype=torch.bool)  # 3 siblings: past + themselves
    visible[:, :past] = True
    visible[range(3), range(past, past + 3)] = True
    parts = [Part(many[0], torch.tensor(prompts[0])),  # a prefill chain
             Part(many[1], torch.tensor(prompts[1][-4:]), logits_from=3),  # chain after a past
             Part(many[2], torch.tensor([11, 12, 13]), torch.full((3,), past), visible),
             Part(many[3], torch.tensor(prompts[3][-4:-3]), logits_from=1)]  # no logits
    got = lm.forward_many(parts)
    want = [lm.forward(solo[0], torch.tensor(prompts[0])),
            lm.forward(solo[1], torch.tensor(prompts[1][-4:]))[3:],
            lm.forward(solo[2], torch.tensor([11, 12, 13]), torch.full((3,), past), visible),
            lm.forward(solo[3], torch.tensor(prompts[3][-4:-3]))[1:]]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"request {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.allclose(g, w, atol=ATOL), \
            f"request {i}: logits differ by {(g - w).abs().max()}"
    for i, (a, b) in enumerate(zip(many, solo)):
        assert len(a) == len(b), f"request {i}: {len(a)} cache rows vs {len(b)}"
        for (k, v), (rk, rv) in zip(a.tensors(), b.tensors()):
            assert torch.allclose(k, rk, atol=ATOL) and torch.allclose(v, rv, atol=ATOL)


def test_batched_drafts_equal_drafts_one_at_a_time(draft, chat_prompt_ids):
    """draft_many (one forward per tree level for all requests) drafts the trees that drafting
    each request alone does, through rollbacks, a catch-up (depth 0) and mixed widths, and
    leaves each cache equal to a fresh prefill of the committed tokens."""
    prompts = {i: chat_prompt_ids(i) for i in (3, 4, 5, 6)}
    for i, prompt in prompts.items():
        draft.prefill(f"solo{i}", prompt)
        draft.prefill(f"many{i}", prompt)
    new = {i: [] for i in prompts}
    for round_ in range(3):
        shape = {i: (0 if (round_, i) == (1, 3) else 3, 1 if i == 4 else 2) for i in prompts}
        solo = {i: draft.draft(f"solo{i}", new[i], *shape[i])[0] for i in prompts}
        many = draft.draft_many([(f"many{i}", new[i], *shape[i]) for i in prompts])
        for (i, want), (got, seconds) in zip(solo.items(), many):
            assert (got.tokens, got.parents) == (want.tokens, want.parents), \
                f"round {round_}, request {i}: batched tree differs"
            assert seconds > 0
            # accept the first node's path when there is one, then a bonus token it missed
            accepted = [want.tokens[0]] if len(want) else []
            new[i] = accepted + [next(t for t in range(100, 200) if t not in want.tokens)]
    for i in prompts:
        state = draft.requests[f"many{i}"]
        assert state.tokens == draft.requests[f"solo{i}"].tokens
        draft.draft_many([(f"many{i}", [], 0, 1)])  # catch up: every committed row computed
        assert_same_cache(draft.lm, state.cache, state.tokens[:-1])


def test_measuring_the_drafting_cost_leaves_no_request_behind(draft, chat_prompt_ids):
    """`measure` (run when a drafter loads its models) times drafting forwards on a request of
    its own and drops it; the requests being served keep their caches."""
    prompt = chat_prompt_ids(3)
    draft.prefill("m", prompt)
    before = draft.draft("m", [], depth=3, width=1)[0]
    draft.draft("m", [before.tokens[0], 7], depth=0, width=1)
    held = set(draft.requests)
    assert draft.measure(context=16, depth=3, reps=2) == draft.level_seconds > 0
    assert draft.prefill_token_seconds > 0
    assert set(draft.requests) == held
    state = draft.requests["m"]
    assert state.tokens == prompt + [before.tokens[0], 7]
    assert_same_cache(draft.lm, state.cache, state.tokens[:-1])
    draft.release("m")


def test_drafting_stops_below_an_unsure_level_and_rolls_back_as_usual(draft, chat_prompt_ids):
    """min_probability: the tree ends at the first level whose likeliest node the draft gives
    less than it (that level kept); its probabilities are the full-depth tree's, the tree is
    its prefix, and rollback after it leaves the cache a fresh prefill's."""
    prompt = chat_prompt_ids(3)
    draft.prefill("full", prompt)
    full, _ = draft.draft("full", [], depth=12, width=1)
    probs = torch.tensor(full.scores).diff(prepend=torch.zeros(1)).exp().tolist()
    threshold = sorted(probs[:-1])[len(probs) // 2]  # some level falls below it
    stop = next(i for i, p in enumerate(probs) if p < threshold)
    draft.prefill("sure", prompt)
    tree, _ = draft.draft("sure", [], depth=12, width=1, min_probability=threshold)
    assert list(tree.tokens) == list(full.tokens[:stop + 1])
    draft.prefill("zero", prompt)
    assert draft.draft("zero", [], depth=12, width=1, min_probability=0.0)[0].tokens == full.tokens
    accepted = list(tree.tokens[:1])
    draft.draft("sure", accepted + [7], depth=0, width=1)
    state = draft.requests["sure"]
    assert_same_cache(draft.lm, state.cache, state.tokens[:-1])
    with pytest.raises(ValueError, match="min_probability"):
        draft.draft("sure", [], depth=2, width=1, min_probability=1.0)
