"""services/drafter/vocab.py: draft LM heads over the most frequent tokens (FR-Spec)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from specmesh_kernels.int4 import Int4Linear
from specmesh_kernels.onednn import PackedLinear
from specmesh_services.drafter.models import build_draft_models
from specmesh_services.drafter.vocab import SubsetHead, frequent_tokens, restrict_vocab, token_counts
from test_lossless_greedy import assert_lossless_with_drafts  # noqa: E402


def test_frequent_tokens_ranks_by_count_then_id_and_keeps_the_special_ones():
    counts = np.array([5, 9, 0, 9, 1, 7])
    assert frequent_tokens(counts, 3).tolist() == [1, 3, 5]  # 9, 9 (lower id first), 7
    assert frequent_tokens(counts, 2, always=[2, 99]).tolist() == [1, 2, 3]  # 99: no such id
    assert frequent_tokens(counts, 100).tolist() == list(range(6))
    with pytest.raises(ValueError, match="k >= 1"):
        frequent_tokens(counts, 0)


def test_token_counts_match_a_loop_and_skip_document_separators(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=10_000).astype("<u4")
    tokens[::97] = 2 ** 32 - 1  # separators lie beyond the vocabulary
    path = tmp_path / "tokens.u32"
    tokens.tofile(path)
    loop = Counter(int(t) for t in tokens if t < 50)
    assert token_counts(path, 50).tolist() == [loop[i] for i in range(50)]


@pytest.mark.parametrize("bias", [False, True])
def test_subset_head_gives_the_full_heads_logits_on_kept_tokens_only(bias):
    torch.manual_seed(0)
    head = nn.Linear(32, 100, bias=bias)
    keep = torch.tensor([0, 3, 7, 50, 99])
    sub = SubsetHead(head, keep)
    assert "5 of 100 tokens" in repr(sub)
    with torch.inference_mode():
        x = torch.randn(2, 3, 32)
        full, got = head(x), sub(x)
    assert got.shape == full.shape
    torch.testing.assert_close(got[..., keep], full[..., keep])
    outside = torch.ones(100, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(got[..., outside]).all()
    assert set(torch.softmax(got, -1).argmax(-1).flatten().tolist()) <= set(keep.tolist())
    with pytest.raises(ValueError, match=r"in \[0, 100\)"):
        SubsetHead(head, torch.tensor([5, 100]))


def test_restrict_vocab_comes_before_packing(target_path):
    from specmesh_services.common import models

    model = models.load_model(target_path, torch.float32, linear="torch")
    assert restrict_vocab(model, torch.arange(1000)) == 1000
    assert isinstance(model.lm_head, SubsetHead)
    assert model.model.embed_tokens.weight.shape[0] == model.config.vocab_size  # untouched
    packed = models.load_model(target_path, torch.float32)
    assert isinstance(packed.lm_head, PackedLinear)
    with pytest.raises(TypeError, match="before packing or quantizing"):
        restrict_vocab(packed, torch.arange(1000))


def test_draft_vocab_needs_a_datastore(base_settings, tmp_path):
    settings = base_settings.with_overrides(drafters=["layers:4"], draft_vocab=1000,
                                            **{"datastore.path": tmp_path / "none"})
    with pytest.raises(ValueError, match="draft_vocab=1000 counts tokens in the datastore"):
        build_draft_models(settings)


def test_draft_with_a_small_vocabulary_is_lossless(base_settings, small_datastore, questions,
                                                   hf_greedy_reference, compute):
    """An int4 draft proposing only the 4096 most frequent tokens of the datastore's corpus:
    its head is the quantized subset, it guesses only those tokens, and every output is the
    target's own greedy output (8 MT-Bench questions x 64 tokens, 4 in flight, width 2)."""
    settings = base_settings.with_overrides(
        drafters=["layers:30@int4"], draft_vocab=4096,
        **{"datastore.path": small_datastore, "speculation.depth": 3, "speculation.width": 2,
           "speculation.source": "model"})
    (draft,) = compute.submit(build_draft_models, settings).result()
    # a lean draft (lean.py): the head's rows are the subset's, its columns mapped to token ids
    assert isinstance(draft.lm.linears["head"], Int4Linear)
    kept = set(draft.lm.token_ids.tolist())
    assert draft.lm.linears["head"].out_features == len(kept)
    assert 4096 <= len(kept) < 4096 + 32  # plus the tokenizer's special tokens
    tokens = list(range(1, 40))
    draft.prefill("r", tokens)
    tree, _ = draft.draft("r", [], 4, 2)
    assert tree.tokens and set(tree.tokens) <= kept
    del draft
    assert_lossless_with_drafts(settings, questions[:8], hf_greedy_reference, compute)
