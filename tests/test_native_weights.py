"""Native target weights (`target_weights=native`): the layers a GGUF stores as 4-bit blocks keep
their codes and run through torch's CPU int4 kernel; the rest stay float32.

The lossless promise is relative to the target as served. The int4 kernel multiplies bf16
activations, so as with a bf16 target a verified token may differ from plain decoding only
where the target's top two logits are tied within bf16 rounding (tests/test_bf16_ties.py runs
both). Here: which layers go int4, that a row's result does not depend on the call's size, and
the logits against the dequantized float32 model's within a stated tolerance.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from specmesh_kernels.linear import Int4Linear, exact_int4, int4_supports
from specmesh_services.common import models
from specmesh_services.verifier.server import served_weights

pytestmark = pytest.mark.skipif(int4_supports() is not None, reason=str(int4_supports()))
SMOLLM2_LINEARS = 30 * 7  # q, k, v, o, gate, up, down per layer: all Q4_1 in its GGUF
LOGIT_TOLERANCE = 2.0  # max |logit| difference to float32 (measured 1.2 on 4 prompts; range ~40)


def four_bit_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 block dequantizes: q * scale + low per group of 32, q spanning 0..15."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(rows, cols // 32, 1, generator=gen) * 0.01 + 1e-3
    low = torch.randn(rows, cols // 32, 1, generator=gen) * 0.05
    return (codes * scale + low).view(rows, cols)


def test_exact_int4_detects_four_bit_groups():
    weight = four_bit_weight(64, 128)
    assert exact_int4(weight)
    assert not exact_int4(weight + 1e-4 * torch.randn(64, 128))
    assert not exact_int4(torch.randn(64, 100))  # inputs not a multiple of the group


def test_int4_rows_do_not_depend_on_the_call_size():
    """What the lossless rule needs of the target: a row's result is the same alone or among
    others (plain decoding runs 1 row, a verify step a tree's rows)."""
    linear = nn.Linear(256, 96, bias=True)
    linear.weight.data = four_bit_weight(96, 256)
    layer = Int4Linear(linear, dense_rows=None)
    x = torch.randn(40, 256)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    for n in (2, 9, 16, 17, 40):
        assert torch.equal(layer(x[:n]), alone[:n]), n
    # scales and offsets are held in bf16 and the product returned in bf16: ~1% error
    reference = x.bfloat16().double() @ linear.weight.double().T + linear.bias.double()
    assert (alone.double() - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.fixture(scope="module")
def native_target(target_path):
    return models.load_model(target_path, torch.float32, weights="native")


def test_native_smollm2_serves_its_q4_layers_in_int4(native_target, hf_target, chat_prompt_ids):
    int4 = [m for m in native_target.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == SMOLLM2_LINEARS
    assert not isinstance(native_target.lm_head, Int4Linear)  # Q8_0: kept in float32
    agree = total = 0
    with torch.inference_mode():
        for i in range(4):
            ids = torch.tensor([chat_prompt_ids(i)])
            native, exact = native_target(ids).logits[0], hf_target(ids).logits[0]
            assert (native - exact).abs().max() < LOGIT_TOLERANCE
            agree += int((native.argmax(-1) == exact.argmax(-1)).sum())
            total += ids.shape[1]
    assert agree / total > 0.95


def test_auto_serves_native_weights_only_where_they_are_four_bit(base_settings, target_path,
                                                                  tmp_path):
    auto = base_settings.with_overrides(dtype="auto", target_weights="auto")
    assert served_weights(auto, target_path) == "native"  # SmolLM2: every layer Q4_1
    assert served_weights(base_settings, target_path) == "float"  # an explicit dtype is served
    assert served_weights(auto.with_overrides(target_weights="float"), target_path) == "float"
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(64, 64)},
              str(tmp_path / "model.safetensors"))
    assert models.int4_share(tmp_path) == 0.0
    assert served_weights(auto, tmp_path) == "float"
