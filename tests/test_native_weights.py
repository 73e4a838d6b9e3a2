"""Native target weights (`target_weights=native`): the layers a GGUF stores as 4-bit blocks keep
their codes and run through torch's CPU int4 kernel; the rest are held in bf16 (oneDNN).

The lossless promise is relative to the target as served. The int4 kernel multiplies bf16
activations, so as with a bf16 target a verified token may differ from plain decoding only
where the target's top two logits are tied within bf16 rounding (tests/test_bf16_ties.py runs
both). Here: which layers go int4 (Q4_0 / Q4_1 in SmolLM2-135M, Q4_K in Qwen2.5-Coder-1.5B),
that their codes are the GGUF's, that a row's result does not depend on the call's size, and
the logits against the dequantized float32 model's within a stated tolerance.
"""
from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from specmesh_kernels.int4 import Int4Linear, exact_int4, int4_lattice, int4_supports
from specmesh_kernels.linear_rules import native_rest
from specmesh_kernels.row_stable import RowStableLinear, row_stable_supports
from specmesh_services.common import models
from specmesh_services.common.prompts import chat_ids
from specmesh_services.verifier.server import served_weights

pytestmark = pytest.mark.skipif(int4_supports() is not None, reason=str(int4_supports()))
SMOLLM2_LINEARS = 30 * 7  # q, k, v, o, gate, up, down per layer: all Q4_1 in its GGUF
LOGIT_TOLERANCE = 2.0  # max |logit| difference to float32 (measured 1.2 on 4 prompts; range ~40)
QWEN = "qwen2.5-coder-1.5b"
QWEN_Q4K_LINEARS = 168  # 28 layers x 7 linears, less 14 ffn_down and 14 attn_v stored as Q6_K
QWEN_LOGIT_TOLERANCE = 2.0  # max |logit| difference to float32 (measured 0.6-1.0 on 8 prompts;
# logits span ~56)


def four_bit_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 block dequantizes: q * scale + low per group of 32, q spanning 0..15."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(rows, cols // 32, 1, generator=gen) * 0.01 + 1e-3
    low = torch.randn(rows, cols // 32, 1, generator=gen) * 0.05
    return (codes * scale + low).view(rows, cols)


def q4k_weight(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, codes) as a GGUF Q4_K sub-block of 32 dequantizes, (d * sc) * q - dmin * m in
    float32 with d, dmin float16 and sc, m 6-bit: q in 0..15, but a group's codes run from
    0..3 up to 11..15, some groups use every other level, one per row is constant."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols // 32, 1)
    lo = torch.randint(0, 4, shape, generator=gen)
    hi = torch.randint(11, 16, shape, generator=gen)
    codes = lo + (torch.rand(rows, cols // 32, 32, generator=gen) * (hi - lo + 1)).floor().long()
    codes[:, ::5] = codes[:, ::5] // 2 * 2  # even codes only: a lattice of twice the step
    codes[:, 1] = 7  # a constant group
    d = (torch.rand(rows, 1, 1, generator=gen) * 1e-3 + 1e-4).half().float()
    dmin = (torch.rand(rows, 1, 1, generator=gen) * 1e-3 + 1e-4).half().float()
    sc = torch.randint(1, 64, shape, generator=gen).float()
    m = torch.randint(0, 64, shape, generator=gen).float()
    weight = (d * sc) * codes.float() - dmin * m
    return weight.view(rows, cols), codes.view(rows, cols)


def q6k_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights as a GGUF Q6_K sub-block of 16 dequantizes: d * sc * q, q in -32..31."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (rows, cols // 16, 16), generator=gen).float()
    sc = torch.randint(-128, 128, (rows, cols // 16, 1), generator=gen).float()
    return (1e-4 * sc * q).view(rows, cols)


def bf16_error(t: torch.Tensor) -> torch.Tensor:
    return (t.bfloat16().float() - t).abs()


def linear_of(weight: torch.Tensor, bias: bool = True) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    linear.weight.data = weight
    return linear


def assert_rows_invariant(layer: nn.Module, features: int, most: int = 24) -> None:
    """Every row of a call of 1..`most` rows (prefixes, singles, windows) equals that row in a
    call of `most` rows: what the lossless rule needs of a target (plain decoding runs 1 row, a
    verify step a tree's rows)."""
    x = torch.randn(most, features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = layer(x)
        calls = [(i, 1) for i in range(most)] + [(0, n) for n in range(2, most)]
        calls += [(i, n) for i in range(1, most, 5) for n in (2, 3, 9) if i + n <= most]
        for i, n in calls:
            part = layer(x[i:i + n])
            assert torch.equal(part, full[i:i + n]), (
                f"{layer}: rows {i}..{i + n - 1} of a {n}-row call differ from a {most}-row "
                f"call's by {(part - full[i:i + n]).abs().max().item():.3g}")


# ---------------------------------------------------------------------------------------------
# detection and codes


def test_exact_int4_detects_four_bit_groups():
    weight = four_bit_weight(64, 128)
    assert exact_int4(weight)
    assert not exact_int4(weight + 1e-4 * torch.randn(64, 128))
    assert not exact_int4(torch.randn(64, 100))  # inputs not a multiple of the group


def test_lattice_detects_q4k_groups_that_do_not_span_the_codes():
    weight, codes = q4k_weight(96, 256)
    assert exact_int4(weight)
    lattice = int4_lattice(weight)
    low, step = (t.repeat_interleave(32, 1) for t in (lattice.low, lattice.step))
    # on the lattice to float32 rounding (1e-6 of a level), every code in 0..15
    assert int(lattice.codes.max()) <= 15
    assert ((low + lattice.codes.float() * step - weight).abs() <= 1e-4 * step + 1e-9).all()
    # the codes are the block's own shifted to start at 0 where they span 8 levels or more (a
    # group of fewer, or of every other level, may sit as exactly on a finer lattice)
    groups = codes.view(96, -1, 32)
    shifted = groups - groups.amin(-1, keepdim=True)
    wide = shifted.amax(-1) >= 8
    wide[:, ::5] = False
    assert wide.float().mean() > 0.5
    assert torch.equal(lattice.codes.view(96, -1, 32)[wide].long(), shifted[wide])
    assert not exact_int4(weight + 1e-3 * step * torch.randn(96, 256))  # off the lattice
    assert not exact_int4(q6k_weight(64, 256))  # 6-bit sub-blocks of 16
    assert not exact_int4(torch.full((16, 64), float("nan")))


def test_int4_layer_keeps_the_lattice_codes():
    """Int4Linear from `int4_lattice` codes reproduces the dequantized weights up to the kernel's
    bf16 scale and offset (and its bf16 output); min/max rounding of the same groups does not."""
    weight, _ = q4k_weight(64, 128)
    linear = linear_of(weight, bias=False)
    lattice = int4_lattice(weight)
    eye = torch.eye(128)
    with torch.inference_mode():
        native = Int4Linear(linear, dense_rows=None, codes=lattice)(eye).T  # [64, 128]: W
        rounded = Int4Linear(linear, dense_rows=None)(eye).T
    low, step = (t.repeat_interleave(32, 1) for t in (lattice.low, lattice.step))
    offset = low + 8 * step
    bound = (8 * bf16_error(step) + bf16_error(offset) + weight.abs() * 2 ** -8  # output: bf16
             + 1e-9)
    assert ((native - weight).abs() <= bound).all()
    assert not ((rounded - weight).abs() <= bound).all()  # codes of the wrong step


def test_int4_rows_do_not_depend_on_the_call_size():
    linear = nn.Linear(256, 96, bias=True)
    linear.weight.data = four_bit_weight(96, 256)
    layer = Int4Linear(linear, dense_rows=None)
    assert_rows_invariant(layer, 256, most=40)
    x = torch.randn(40, 256)
    with torch.inference_mode():
        y = layer(x)
    # scales and offsets are held in bf16 and the product returned in bf16: ~1% error
    reference = x.bfloat16().double() @ linear.weight.double().T + linear.bias.double()
    assert (y.double() - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (256, 1536), (1536, 8960), (4099, 1536)])
def test_row_stable_layers_do_not_depend_on_the_call_size(dtype, shape):
    """The forms of a native target's non-4-bit layers (Q6_K, Q8_0), on the shapes of Qwen's
    attn_v, ffn_down and (a slice of) its LM head."""
    if row_stable_supports(dtype) is not None:
        pytest.skip(f"no row-stable {dtype} linear here: {row_stable_supports(dtype)}")
    layer = RowStableLinear(linear_of(q6k_weight(*shape)), dtype)
    assert_rows_invariant(layer, shape[1])


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M: Q4_1 layers, a Q8_0 LM head


@pytest.fixture(scope="module")
def native_target(target_path):
    return models.load_model(target_path, torch.float32, weights="native")


def test_native_smollm2_serves_its_q4_layers_in_int4(native_target, hf_target, chat_prompt_ids):
    int4 = [m for m in native_target.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == SMOLLM2_LINEARS
    assert isinstance(native_target.lm_head, RowStableLinear)  # Q8_0: not 4-bit
    assert native_target.lm_head.weight_dtype == native_rest()
    agree = total = 0
    with torch.inference_mode():
        for i in range(4):
            ids = torch.tensor([chat_prompt_ids(i)])
            native, exact = native_target(ids).logits[0], hf_target(ids).logits[0]
            assert (native - exact).abs().max() < LOGIT_TOLERANCE
            agree += int((native.argmax(-1) == exact.argmax(-1)).sum())
            total += ids.shape[1]
    assert agree / total > 0.95


def test_every_native_smollm2_layer_is_row_invariant(native_target):
    layers = [m for m in native_target.modules() if isinstance(m, (Int4Linear, RowStableLinear))]
    assert len(layers) == SMOLLM2_LINEARS + 1
    for layer in layers:
        assert_rows_invariant(layer, layer.in_features, most=12)


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


# ---------------------------------------------------------------------------------------------
# Qwen2.5-Coder-1.5B: Q4_K layers, Q6_K attn_v / ffn_down / LM head


@pytest.fixture(scope="module")
def qwen_path(base_settings):
    try:
        return models.resolve(QWEN, base_settings.cache_dir)
    except models.ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def qwen_prompts(qwen_path):
    tokenizer = models.load_tokenizer(qwen_path)
    return [chat_ids(tokenizer, text) for text in (
        "Write a Python function that returns the n-th Fibonacci number.",
        "Explain what a hash map is in two sentences.")]


@pytest.fixture(scope="module")
def qwen_float_logits(qwen_path, qwen_prompts):
    """The dequantized float32 model's logits (the model is freed before the native one loads:
    both together hold ~9 GiB)."""
    model = models.load_model(qwen_path, torch.float32)
    with torch.inference_mode():
        logits = [model(torch.tensor([ids])).logits[0] for ids in qwen_prompts]
    del model
    gc.collect()
    return logits


@pytest.fixture(scope="module")
def qwen_native(qwen_path, qwen_float_logits):
    return models.load_model(qwen_path, torch.float32, weights="native")


def test_native_qwen_serves_its_q4k_layers_in_int4(qwen_native, qwen_prompts, qwen_float_logits):
    layers = dict(qwen_native.named_modules())
    int4 = [n for n, m in layers.items() if isinstance(m, Int4Linear)]
    rest = [n for n, m in layers.items() if isinstance(m, RowStableLinear)]
    assert len(int4) == QWEN_Q4K_LINEARS
    assert len(rest) == 29 and "lm_head" in rest  # Q6_K: the LM head, 14 ffn_down, 14 attn_v
    assert {n.rsplit(".", 1)[-1] for n in rest} == {"lm_head", "down_proj", "v_proj"}
    agree = total = 0
    with torch.inference_mode():
        for ids, exact in zip(qwen_prompts, qwen_float_logits):
            native = qwen_native(torch.tensor([ids])).logits[0]
            assert (native - exact).abs().max() < QWEN_LOGIT_TOLERANCE
            agree += int((native.argmax(-1) == exact.argmax(-1)).sum())
            total += len(ids)
    assert agree / total > 0.9


def test_every_native_qwen_layer_kind_is_row_invariant(qwen_native):
    """One layer per kind and shape: int4 q/k/o/gate/up (and the Q4_K ffn_down of the other
    layers), RowStableLinear attn_v / ffn_down / LM head."""
    seen = {}
    for name, m in qwen_native.named_modules():
        if isinstance(m, (Int4Linear, RowStableLinear)):
            seen.setdefault((type(m), m.in_features, m.out_features), m)
    assert len(seen) >= 7
    for layer in seen.values():
        assert_rows_invariant(layer, layer.in_features, most=9)


def test_auto_serves_qwen_as_its_registry_entry_says(base_settings, qwen_path):
    share = models.int4_share(qwen_path)
    assert 0.7 < share < 0.75  # 1.11e9 of 1.54e9 linear weights: native would qualify
    auto = base_settings.with_overrides(model=QWEN, dtype="auto", target_weights="auto")
    assert models.REGISTRY[QWEN].auto_weights == "float"  # its draft's chains pay only in bf16
    assert served_weights(auto, qwen_path) == "float"
    plain = auto.with_overrides(**{"speculation.depth": 0})
    assert served_weights(plain, qwen_path) == "native"  # one-row steps: native is faster
    assert served_weights(auto.with_overrides(target_weights="native"), qwen_path) == "native"
