"""Draft models with quantized weights (`SPEC@int8`, `SPEC@int4`): kernels/int8.py's Int8Linear
and int4.py's Int4Linear against the float product, the spec grammar, and the mesh's output with a
quantized draft == the target's own greedy output (the draft only guesses; the float target
decides every token)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specmesh_kernels.cpu_probe import cpu_has
from specmesh_kernels.fp16 import fp16_supports
from specmesh_kernels.int4 import INT4_GROUP, Int4Linear, int4_supports
from specmesh_kernels.int8 import Int8Linear, int8_supports
from specmesh_kernels.linear_rules import quantize_linears
from specmesh_kernels.onednn import PackedLinear, onednn_supports
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.models import DraftSpec, build_draft_models
from test_lossless_greedy import assert_lossless_with_drafts  # noqa: E402

needs_int8 = pytest.mark.skipif(int8_supports() is not None,
                                reason=f"no int8 kernels here: {int8_supports()}")
needs_int4 = pytest.mark.skipif(int4_supports() is not None,
                                reason=f"no int4 kernel here: {int4_supports()}")
LINEARS = {"int8": Int8Linear, "int4": Int4Linear}
WEIGHTS = [pytest.param("int8", marks=needs_int8), pytest.param("int4", marks=needs_int4)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@needs_int8
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 4096)])
def test_int8_linear_is_close_to_the_float_product(shape, bias, narrow):
    if not narrow and not cpu_has("avx512_vnni", "avx_vnni"):
        pytest.skip("full-range int8 weights saturate FBGEMM's int16 pairs on CPUs without "
                    "VNNI (Int8Linear takes 7-bit weight codes there)")
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias)
    q = Int8Linear(linear, narrow=narrow)
    bound = 0.02 if narrow else 0.015  # 7-bit weight codes round twice as coarsely
    with torch.inference_mode():
        for rows in (1, 3, 17):
            x = torch.randn(rows, shape[0])
            assert relative_error(q(x), linear(x)) < bound
        x = torch.randn(2, 5, shape[0])  # [batch, seq, features] as the models call it
        assert q(x).shape == (2, 5, shape[1]) and relative_error(q(x), linear(x)) < bound
        x = torch.randn(shape[0], 3).t()  # non-contiguous input
        assert relative_error(q(x), linear(x)) < bound
        with pytest.raises(TypeError, match="float32 input"):
            q(x.bfloat16())


@needs_int8
def test_narrow_int8_keeps_full_range_activations():
    """A few outlier channels (as transformer activations have) cost the narrow layer far less
    than they cost FBGEMM's reduce_range (7-bit activations), and no pair saturates: the error
    is that of the 7-bit weights, whatever the activations' magnitude."""
    torch.manual_seed(0)
    linear = nn.Linear(1536, 576, bias=False)
    q = Int8Linear(linear, narrow=True)
    x = torch.randn(3, 1536)
    x[:, :4] *= 20
    with torch.inference_mode():
        narrow = relative_error(q(x), linear(x))
        wide = Int8Linear(linear, narrow=False)  # 8-bit weights, activations in 7 bits:
        reduced = relative_error(torch.ops.quantized.linear_dynamic(x, wide.packed, True),
                                 linear(x))
        assert narrow < 0.06 and narrow < 0.7 * reduced
        big = 1e4 * torch.rand(2, 1536)  # all-positive, huge: the pairs' worst case
        assert relative_error(q(big), linear(big)) < 0.02


def dequantized(weight: torch.Tensor, group: int) -> torch.Tensor:
    """The int4 rounding of `weight` as Int4Linear documents it, computed group by group in a
    loop: codes 0..15 between each row-group's minimum and maximum."""
    out = torch.empty_like(weight)
    for r in range(weight.shape[0]):
        for g in range(0, weight.shape[1], group):
            w = weight[r, g:g + group]
            low, step = w.min(), (w.max() - w.min()) / 15
            out[r, g:g + group] = low + step * ((w - low) / step).round().clamp(0, 15)
    return out


@needs_int4
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 40)])
def test_int4_linear_is_the_product_with_its_rounded_weights(shape, bias):
    """Against the loop-rounded weights the only error is the bf16 activations (~0.4%); against
    the float weights, 4-bit rounding of Gaussian weights (~6%). 40 outputs: padded to 48 rows
    (the kernel's multiple of 16) and sliced back."""
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias)
    q = Int4Linear(linear, dense_rows=None)  # int4 for every call (the bf16 copy: below)
    rounded = nn.Linear(*shape, bias=bias)
    with torch.no_grad():
        rounded.weight.copy_(dequantized(linear.weight, INT4_GROUP))
        if bias:
            rounded.bias.copy_(linear.bias)
    with torch.inference_mode():
        for x in (torch.randn(1, shape[0]), torch.randn(17, shape[0]),
                  torch.randn(2, 5, shape[0]), torch.randn(shape[0], 3).t()):
            y = q(x)
            assert y.shape == (*x.shape[:-1], shape[1]) and y.dtype == torch.float32
            assert relative_error(y, rounded(x)) < 0.01
            assert relative_error(y, linear(x)) < 0.08
        with pytest.raises(TypeError, match="float32 input"):
            q(x.bfloat16())
    with pytest.raises(TypeError, match="divisible by 32"):
        Int4Linear(nn.Linear(48, 16))


@needs_int4
@pytest.mark.skipif(onednn_supports(torch.bfloat16) is not None and fp16_supports() is not None,
                    reason="neither oneDNN bf16 nor FBGEMM fp16 here: Int4Linear keeps no copy")
def test_int4_linear_takes_many_rows_through_its_bf16_copy():
    """Calls of >= dense_rows rows (a prefill) use the bf16-rounded weights (~0.4% off the
    float product; oneDNN, or FBGEMM's fp16 kernel on AVX2), fewer rows the int4 codes (~6%),
    and one input split across the threshold gives each part its own path."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=True)
    q = Int4Linear(linear, dense_rows=16)
    kind = "bf16" if onednn_supports(torch.bfloat16) is None else "fp16"
    assert q.dense is not None and f"{kind} for >= 16 rows" in repr(q)
    with torch.inference_mode():
        many, few = torch.randn(16, 576), torch.randn(15, 576)
        assert relative_error(q(many), linear(many)) < 0.01
        assert 0.03 < relative_error(q(few), linear(few)) < 0.08
        assert q(torch.randn(2, 8, 576)).shape == (2, 8, 1536)  # 16 rows in all: bf16
    assert Int4Linear(linear, dense_rows=None).dense is None


@pytest.mark.parametrize("weights", WEIGHTS)
def test_quantize_linears_replaces_every_linear_and_refuses_what_it_cannot_run(weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 16)))
    x = torch.randn(4, 32)
    with torch.inference_mode():
        ref = model(x)
        assert quantize_linears(model, weights) == 2
        assert isinstance(model[0], LINEARS[weights]) and isinstance(model[2][0], LINEARS[weights])
        assert relative_error(model(x), ref) < (0.03 if weights == "int8" else 0.1)
    with pytest.raises(TypeError, match="float32 CPU model"):
        quantize_linears(nn.Sequential(nn.Linear(32, 16)).bfloat16(), weights)
    with pytest.raises(TypeError, match="linear='torch'"):
        quantize_linears(nn.Sequential(PackedLinear(nn.Linear(32, 16))), weights)
    with pytest.raises(ValueError, match="unknown weights 'int2'"):
        quantize_linears(nn.Sequential(nn.Linear(32, 16)), "int2")


@needs_int4
def test_int4_leaves_a_model_it_cannot_quantize_as_it_was():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 16))  # 16 inputs: not a group of 32
    with pytest.raises(TypeError, match="divisible by 32"):
        quantize_linears(model, "int4")
    assert all(type(m) is nn.Linear for m in model)


@pytest.mark.parametrize("spec,parsed", [
    ("layers:8", DraftSpec("layers:8", None, 8)),
    ("layers:8@int8", DraftSpec("layers:8", "int8", 8)),
    ("qwen2.5-coder-0.5b@int8", DraftSpec("qwen2.5-coder-0.5b", "int8", None)),
    ("qwen2.5-coder-0.5b@int4", DraftSpec("qwen2.5-coder-0.5b", "int4", None)),
    ("qwen2.5-coder-0.5b@auto", DraftSpec("qwen2.5-coder-0.5b", "auto", None)),
    ("/models/my-draft", DraftSpec("/models/my-draft", None, None)),
])
def test_draft_specs(spec, parsed):
    assert DraftSpec.parse(spec) == parsed


def test_auto_weights_follow_the_cpu():
    """`@auto`: int4 where torch runs its AVX512 kernels (its int4 GEMM has no other fast
    path), int8 elsewhere; explicit weights are kept as written."""
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    want = "int4" if avx512 and int4_supports() is None else (
        "int8" if int8_supports() is None else ("int4" if int4_supports() is None else None))
    assert DraftSpec.parse("m@auto").quantized() == want
    assert DraftSpec.parse("m@int4").quantized() == "int4"
    assert DraftSpec.parse("m").quantized() is None


@pytest.mark.parametrize("spec,message", [
    ("layers:x", "layers:N with N an integer"),
    ("qwen2.5-coder-0.5b@int2", "after '@' expected one of int8, int4"),
    ("@int8", "no model before '@'"),
])
def test_bad_draft_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        DraftSpec.parse(spec)


# top-1 agreement with the float draft, lowest allowed (docstring below)
AGREEMENT = {"int8": 0.4, "int4": 0.75}


@pytest.mark.parametrize("weights", WEIGHTS)
def test_quantized_draft_of_the_target_guesses_like_the_float_one(weights, base_settings,
                                                                 chat_prompt_ids,
                                                                 hf_greedy_reference, compute):
    """The target's full depth with quantized weights: quantized end to end (the LM head too),
    named by its spec, and its next-token guesses along the target's own greedy continuations
    mostly the float copy's. SmolLM2's activations have outlier channels that FBGEMM's
    per-tensor scale rounds coarsely: 45-65% top-1 agreement with int8 on these prompts
    (Qwen2.5-Coder-0.5B keeps its acceptance: docs/decisions/draft-quantization.md). int4 leaves the
    activations alone and rounds weights in groups of 32: 83-94% here."""
    settings = base_settings.with_overrides(drafters=["layers:30", f"layers:30@{weights}"])
    float_draft, quantized = compute.submit(build_draft_models, settings).result()
    assert quantized.name == f"{settings.model}:layers=30@{weights}"
    assert quantized.kind == "truncated" and isinstance(quantized, DraftModel)
    assert isinstance(quantized.lm.linears["head"], LINEARS[weights])  # a lean draft (lean.py)
    assert quantized.lm.dtype == torch.float32 and quantized.level_seconds > 0

    def guesses(draft: DraftModel, i: int) -> torch.Tensor:
        prompt, reply = chat_prompt_ids(i), hf_greedy_reference[i]
        ids = torch.tensor(prompt + reply)
        logits = draft.lm.forward(draft.lm.new_cache(), ids)
        return logits[len(prompt) - 1:-1].argmax(-1)
    agree = []
    for i in range(3):
        a, b = (compute.submit(guesses, d, i).result() for d in (float_draft, quantized))
        agree.append(float((a == b).float().mean()))
    assert sum(agree) / len(agree) >= AGREEMENT[weights], agree


@pytest.mark.parametrize("weights", WEIGHTS)
def test_quantized_draft_greedy_equals_target_generate(weights, base_settings, questions,
                                                       hf_greedy_reference, compute):
    """Lossless with a quantized draft: 8 MT-Bench questions x 64 tokens, 4 in flight, trees
    of width 2 and depth 3: every output == the target's own `generate(do_sample=False)`."""
    settings = base_settings.with_overrides(
        drafters=[f"layers:30@{weights}"], **{"speculation.depth": 3, "speculation.width": 2})
    assert_lossless_with_drafts(settings, questions[:8], hf_greedy_reference, compute)
