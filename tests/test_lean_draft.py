"""services/drafter/lean.py: the drafter's lean decoder loop against transformers' forward of the
same weights (the reference), for the real Llama model (SmolLM2) and a small random Qwen2 (q/k/v
biases); its draft vocabulary columns; the KV buffers' growth; what it refuses. The drafter's
rollback and batching tests run with it too (test_kv_rollback.py, `draft` fixture)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from specmesh_services.common import models
from specmesh_services.common.lm import CausalLM
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.lean import LeanKV, LeanLM, supports
from specmesh_services.drafter.models import DraftSpec, load_draft_lm
from specmesh_services.drafter.vocab import restrict_vocab

ATOL = 1e-4


def both(model_fn):
    """The same weights as transformers' forward and as a LeanLM."""
    return CausalLM(model_fn(), "hf"), LeanLM(model_fn(), "lean")


def assert_same_forwards(hf: CausalLM, lean: LeanLM, prompt: list[int]):
    """Prefill, a chain after it and a tree level under a visibility mask: the same logits."""
    a, b = hf.new_cache(), lean.new_cache()
    torch.testing.assert_close(lean.prefill(b, prompt[:-3]), hf.prefill(a, prompt[:-3]),
                               atol=ATOL, rtol=0)
    chain = torch.tensor(prompt[-3:])
    torch.testing.assert_close(lean.forward(b, chain), hf.forward(a, chain), atol=ATOL, rtol=0)
    past = len(a)
    visible = torch.zeros(2, past + 2, dtype=torch.bool)
    visible[:, :past - 1] = True  # two siblings below the second-to-last row
    visible[[0, 1], [past, past + 1]] = True
    level = torch.tensor([5, 9])
    position = torch.full((2,), past - 1)
    torch.testing.assert_close(lean.forward(b, level, position, visible),
                               hf.forward(a, level, position, visible), atol=ATOL, rtol=0)
    assert len(a) == len(b)
    for (k, v), (rk, rv) in zip(b.tensors(), a.tensors()):
        torch.testing.assert_close(k, rk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ATOL, rtol=0)


def test_lean_forward_equals_transformers_on_the_real_llama(target_path, chat_prompt_ids):
    hf, lean = both(lambda: models.load_model(target_path, torch.float32, num_layers=12,
                                              linear="torch"))
    assert_same_forwards(hf, lean, chat_prompt_ids(0)[:60])


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-zero q/k/v biases: transformers initializes them to zero
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def test_lean_forward_equals_transformers_on_qwen2_with_biases():
    hf, lean = both(tiny_qwen2)
    assert_same_forwards(hf, lean, list(range(7, 47)))


def test_lean_drafts_the_trees_transformers_drafts(target_path, chat_prompt_ids):
    """Greedy top-k trees through rollbacks, the LeanKV buffers grown past their first capacity
    (a 300-token context), the same tokens as transformers' forward drafts."""
    hf, lean = both(lambda: models.load_model(target_path, torch.float32, num_layers=12,
                                              linear="torch"))
    drafts = [DraftModel(hf, "d", "truncated"), DraftModel(lean, "d", "truncated")]
    prompt = (chat_prompt_ids(1) * 8)[:300]
    trees = [[], []]
    for d, out in zip(drafts, trees):
        d.prefill("r", prompt)
        new: list[int] = []
        for _ in range(4):
            tree, _ = d.draft("r", new, depth=3, width=2)
            out.append(tree.tokens)
            new = [tree.tokens[0], 17]  # the first node accepted, then a bonus it missed
    assert trees[0] == trees[1]
    assert drafts[1].requests["r"].cache.keys.shape[2] >= 512  # 256 rows at first, doubled


def test_lean_logits_are_the_draft_vocabulary_columns(target_path, chat_prompt_ids):
    """With a SubsetHead the lean forward returns the kept tokens' logits only, in `token_ids`
    order (the full head's logits at those ids), and the drafter maps columns to token ids."""
    keep = torch.tensor(sorted({0, 2, *range(100, 2100, 3)}))
    full = LeanLM(models.load_model(target_path, torch.float32, num_layers=6, linear="torch"),
                  "full")
    model = models.load_model(target_path, torch.float32, num_layers=6, linear="torch")
    restrict_vocab(model, keep)
    subset = LeanLM(model, "subset")
    assert full.token_ids is None and torch.equal(subset.token_ids, keep)
    prompt = chat_prompt_ids(2)[:30]
    want = full.prefill(full.new_cache(), prompt)[keep]
    torch.testing.assert_close(subset.prefill(subset.new_cache(), prompt), want, atol=ATOL,
                               rtol=0)
    draft = DraftModel(subset, "subset", "truncated")
    draft.prefill("r", prompt)
    tree, _ = draft.draft("r", [], depth=3, width=3)
    assert set(tree.tokens) <= set(keep.tolist())
    assert tree.tokens[0] == int(keep[want.argmax()])


def test_lean_kv_keeps_and_truncates_like_the_drafter_expects():
    kv = LeanKV(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, capacity=4)
    kv.reserve(6)
    assert kv.keys.shape[2] == 8
    kv.keys[:, :, :6] = torch.arange(6.0)[None, None, :, None]
    kv.length = 6
    kv.keep(2, [3, 5])
    assert len(kv) == 4 and kv.keys[0, 0, :4, 0].tolist() == [0, 1, 3, 5]
    kv.truncate(3)
    assert len(kv) == 3
    with pytest.raises(ValueError, match="ascending and >= 2"):
        kv.keep(2, [1])


def test_architectures_lean_drafts_do_not_cover_are_refused():
    class Stub:
        def __init__(self, config):
            self.config = config

    assert supports(Stub(LlamaConfig())) is None
    assert "architecture gpt2" in supports(Stub(type("C", (), {"model_type": "gpt2"})()))
    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 10000.0})
    assert "RoPE type linear" in supports(Stub(scaled))
    assert "sliding-window" in supports(Stub(Qwen2Config(use_sliding_window=True)))
    with pytest.raises(ValueError, match="the lean forward does not cover this model"):
        LeanLM(Stub(scaled), "x")


def test_draft_runner_setting_picks_the_forward(base_settings, target_path):
    spec = DraftSpec.parse("layers:4")
    for runner, kind in (("auto", LeanLM), ("lean", LeanLM), ("transformers", CausalLM)):
        settings = base_settings.with_overrides(draft_runner=runner)
        assert type(load_draft_lm(spec, settings, target_path, "d")) is kind
