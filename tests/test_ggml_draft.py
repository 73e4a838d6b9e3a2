"""Draft models on llama.cpp's kernels (services/drafter/ggml_lm.py), on the default model's GGUF
as its own draft: drafted chains are the model's greedy decoding, after rollbacks too; each node
of a wide tree gets the logits of its path decoded alone; requests drafted together draft what
they draft alone; released requests give their sequences back; `draft_runner=ggml` refuses what
llama.cpp cannot run. Skipped where llama-cpp-python is not installed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh_services.common.config import Settings
from specmesh_services.common.lm import Part
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.ggml_lm import GgmlDraftLM
from specmesh_services.drafter.models import DraftSpec, ggml_draft
from specmesh_services.common.ggml_model import GgmlModel

TOLERANCE = 1e-3  # max |difference| / max |logit| of a row (as tests/test_ggml_tree.py)
# after a rollback a new row may land in a freed cell before the kept ones, and the attention
# sums its cells in another order: measured on SmolLM2 Q4_1, up to 1.5% of the largest logit
REORDERED = 0.03


@pytest.fixture(scope="module")
def draft(gguf):
    lm = GgmlDraftLM(gguf, "smollm2-135m", n_ctx=2048, n_batch=256, n_seq_max=32, threads=2)
    yield DraftModel(lm, "smollm2-135m", "model")
    lm.close()


@pytest.fixture(scope="module")
def reference(gguf):
    model = GgmlModel(gguf, n_ctx=1024, n_batch=256, n_seq_max=2, threads=2)
    yield model
    model.close()


def logits_after(model: GgmlModel, context: list[int]) -> np.ndarray:
    """The last row's logits of `context` decoded from nothing as one chain."""
    model.seq_remove(-1)
    n = len(context)
    return model.decode(context, list(range(n)), [[0]] * n, [False] * (n - 1) + [True])[0]


def greedy(model: GgmlModel, context: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `context`, one decode a token."""
    context, out = list(context), []
    model.seq_remove(-1)
    model.decode(context[:-1], list(range(len(context) - 1)), [[0]] * (len(context) - 1),
                 [False] * (len(context) - 1))
    for _ in range(n):
        row = model.decode([context[-1]], [len(context) - 1], [[0]], [True])[0]
        context.append(int(row.argmax()))
        out.append(context[-1])
    return out


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_drafted_chains_are_the_models_greedy_decoding_across_rollbacks(draft, reference,
                                                                        tokenizer):
    context = ids(tokenizer, "The three primary colors are red, blue and")
    draft.prefill("r", context)
    new: list[int] = []
    try:
        for step in range(4):
            tree, _ = draft.draft("r", new, depth=4, width=1)
            want = greedy(reference, context, 4)
            assert list(tree.tokens) == want, f"step {step}"
            assert list(tree.parents) == [-1, 0, 1, 2]
            # the target accepts the first drafted token and disagrees with the second
            other = (want[1] + 1) % draft.lm.vocab_size
            new = [want[0], other]
            context += new
    finally:
        draft.release("r")


def test_each_node_of_a_wide_tree_sees_its_path_only(gguf, reference, tokenizer):
    lm = GgmlDraftLM(gguf, "t", n_ctx=1024, n_batch=64, n_seq_max=16, threads=2)
    try:
        context = ids(tokenizer, "def add(a, b):\n    return")
        cache = lm.new_cache()
        lm.prefill(cache, context)
        n = len(context)
        # level 1: two children of the root (row n - 1); level 2: two children of the first
        level1 = [11, 22]
        visible = torch.zeros(2, n + 2, dtype=torch.bool)
        visible[:, :n] = True
        visible[0, n], visible[1, n + 1] = True, True
        got1 = lm.forward_many([Part(cache, torch.tensor(level1), torch.full((2,), n),
                                     visible)])[0]
        level2 = [33, 44]
        visible = torch.zeros(2, n + 4, dtype=torch.bool)
        visible[:, :n + 1] = True  # the prefix and the first level-1 node (row n)
        visible[0, n + 2], visible[1, n + 3] = True, True
        got2 = lm.forward_many([Part(cache, torch.tensor(level2), torch.full((2,), n + 1),
                                     visible)])[0]
        paths = [[11], [22], [11, 33], [11, 44]]
        for row, path in zip([*got1, *got2], paths):
            want = logits_after(reference, context + path)
            scale = float(np.abs(want).max())
            assert float(np.abs(row.numpy() - want).max()) <= TOLERANCE * scale, path
        with pytest.raises(ValueError, match="its ancestors and itself only"):
            bad = torch.ones(1, n + 5, dtype=torch.bool)  # sees both level-2 siblings
            lm.forward_many([Part(cache, torch.tensor([55]), torch.full((1,), n + 2), bad)])
        # accept root -> 11 -> 44: the cache then holds that chain as committed rows
        cache.keep(n - 1, [n - 1, n, n + 3])
        assert [pos for pos, _, _ in cache.rows] == list(range(n + 2))
        assert lm.model.seq_max(cache.seq) == n + 1
        got = lm.forward_many([Part(cache, torch.tensor([7]), logits_from=0)])[0][0].numpy()
        want = logits_after(reference, context + [11, 44, 7])
        scale = float(np.abs(want).max())
        assert float(np.abs(got - want).max()) <= REORDERED * scale
        # the reordered sums may swap a near tie (an AMX Xeon: the top two 0.02 apart of ~30)
        second, first = np.argsort(want)[-2:]
        near_tie = want[first] - want[second] < 0.01 * scale
        assert got.argmax() == first or (near_tie and got.argmax() == second)
        cache.close()
        assert len(lm._free) == 16  # every sequence id back
    finally:
        lm.close()


def test_requests_drafted_together_draft_what_they_draft_alone(draft, tokenizer):
    prompts = [ids(tokenizer, "Write a haiku about the sea:"),
               ids(tokenizer, "import numpy as np\n\ndef mean(xs):")]
    alone = []
    for i, p in enumerate(prompts):
        draft.prefill(f"a{i}", p)
        alone.append(draft.draft(f"a{i}", [], depth=5, width=2)[0])
        draft.release(f"a{i}")
    for i, p in enumerate(prompts):
        draft.prefill(f"b{i}", p)
    together = draft.draft_many([(f"b{i}", [], 5, 2) for i in range(2)])
    for i in range(2):
        draft.release(f"b{i}")
    for a, (b, _) in zip(alone, together):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert len(draft.lm._free) == draft.lm.model.n_seq_max


def test_llama_cpp_drafts_when_asked_and_refuses_what_it_cannot_run(gguf):
    asked = Settings(model="smollm2-135m", target_runner="ggml", draft_runner="ggml")
    assert ggml_draft(DraftSpec.parse("smollm2-135m"), asked)
    assert ggml_draft(DraftSpec.parse("smollm2-135m@auto"), asked)
    # auto keeps the torch draft, also beside a llama.cpp target
    assert not ggml_draft(DraftSpec.parse("smollm2-135m"), asked.with_overrides(
        draft_runner="auto"))
    for spec, why in (("layers:8", "layers:N drafts are cut from the torch target"),
                      ("smollm2-135m@int4", "@int4 is a torch quantization"),
                      ("no-such-model", "has no GGUF file")):
        with pytest.raises(ValueError, match=why):
            ggml_draft(DraftSpec.parse(spec), asked)


def test_a_refused_level_leaves_the_cache_as_it_was(gguf, tokenizer):
    """Out of sequence ids (one per tree row) or a mask that is not a path: the error names
    it, and the request's rows and the free ids are those before the call."""
    lm = GgmlDraftLM(gguf, "t", n_ctx=512, n_batch=64, n_seq_max=3, threads=2)
    try:
        cache = lm.new_cache()
        context = ids(tokenizer, "Hello there")
        lm.prefill(cache, context)
        n, rows, free = len(context), list(cache.rows), list(lm._free)
        visible = torch.zeros(3, n + 3, dtype=torch.bool)
        visible[:, :n] = True
        for i in range(3):
            visible[i, n + i] = True
        with pytest.raises(ValueError, match="no free llama.cpp sequence"):
            lm.forward_many([Part(cache, torch.tensor([5, 6, 7]), torch.full((3,), n),
                                  visible)])
        assert cache.rows == rows and sorted(lm._free) == sorted(free)
        got = lm.forward_many([Part(cache, torch.tensor([5, 6]), torch.full((2,), n),
                                    visible[:2, :n + 2])])[0]
        assert got.shape == (2, lm.vocab_size)
    finally:
        lm.close()
