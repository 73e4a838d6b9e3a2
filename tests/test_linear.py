"""kernels/linear.py: oneDNN-packed linear layers against torch's linear (the reference)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.linear import PackedLinear, onednn_supports, pack_linears
from services.common import models

pytestmark = pytest.mark.skipif(onednn_supports(torch.float32) is not None,
                                reason="oneDNN cannot run float32 linears here")


@pytest.mark.parametrize("keep_dense", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 49152)])
def test_packed_linear_matches_torch(shape, bias, keep_dense):
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias)
    packed = PackedLinear(linear, keep_dense)
    assert (packed.dense is not None) == keep_dense
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 17, 64):
            x = torch.randn(rows, shape[0])
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
        x = torch.randn(2, 5, shape[0])  # [batch, seq, features] as the models call it
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
        x = torch.randn(shape[0], 3).t()  # non-contiguous input
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)


def test_packed_rows_do_not_depend_on_the_rows_beside_them():
    """Through oneDNN a row's product is the same whatever rows share the call (torch's MKL path
    differs in the last bits): a large layer's verify rows equal what plain steps compute."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False), keep_dense=False)
    x = torch.randn(16, 576)
    with torch.inference_mode():
        full = packed(x)
        for i in range(16):
            assert torch.equal(packed(x[i:i + 1]), full[i:i + 1])


def test_pack_linears_backends():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    assert pack_linears(model, "torch") == 0 and type(model[0]) is nn.Linear
    x = torch.randn(3, 8)
    with torch.inference_mode():
        ref = model(x)
        assert pack_linears(model, "auto") == 2
        assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
        assert model[0].dense is not None  # small: one-row calls stay with torch
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown linear backend"):
        pack_linears(model, "mkl")


def test_bf16_follows_what_the_cpu_supports():
    model = nn.Sequential(nn.Linear(8, 16)).to(torch.bfloat16)
    reason = onednn_supports(torch.bfloat16)
    if reason is None:
        assert pack_linears(model, "onednn") == 1
    else:  # e.g. AVX2 without AVX512-BF16: auto keeps torch's, onednn says why it cannot
        with pytest.raises(RuntimeError, match="cannot run torch.bfloat16"):
            pack_linears(model, "onednn")
        assert pack_linears(model, "auto") == 0 and type(model[0]) is nn.Linear


def test_real_model_greedy_matches_torch_linears(target_path, hf_target, tokenizer):
    """SmolLM2 with every linear packed (the tests' target, conftest) decodes like transformers'
    own linears: the same greedy tokens, logits within float32 rounding."""
    assert isinstance(hf_target.lm_head, PackedLinear) and hf_target.lm_head.dense is None
    stock = models.load_model(target_path, torch.float32, linear="torch")
    assert type(stock.lm_head) is nn.Linear
    ids = torch.tensor([tokenizer("def fibonacci(n):").input_ids])
    with torch.inference_mode():
        torch.testing.assert_close(hf_target(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-3)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                  pad_token_id=tokenizer.eos_token_id)
        assert hf_target.generate(ids, **kw).tolist() == stock.generate(ids, **kw).tolist()
