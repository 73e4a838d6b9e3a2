"""The lean decoder's fused elementwise kernels (kernels/decoder_triton.py) against their torch
reference (kernels/decoder_ops.py): each kernel on irregular, seeded shapes in float32 and
bf16 (bf16 to the bit where no reduction or exp is involved), a whole Qwen2 / Llama decoder
with either set of ops (logits, final hidden states, greedy tokens), the bucketed verify step
with the fused ops giving the torch-ops target's greedy stream, and where Triton ops are
refused. The kernels run under TRITON_INTERPRET=1 on the CPU (conftest.py), compiled on a GPU
where CUDA_VISIBLE_DEVICES names one.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from specmesh_kernels import decoder_ops
from specmesh_kernels.decoder_ops import TorchOps
from specmesh_services.common.config import Settings, SettingsError
from specmesh_services.common.device import check
from specmesh_services.common.lean import LeanDecoder

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not (INTERPRET or DEVICE.type == "cuda"),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1 (conftest.py)")
DTYPES = [torch.float32, torch.bfloat16]
BF16_EXACT = INTERPRET  # the interpreter's float32 math is numpy's, as torch's CPU ops are


@pytest.fixture(scope="module")
def ops():
    return decoder_ops.select("triton", DEVICE)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0
          ) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, exact: bool) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if exact:
        assert torch.equal(ours, ref), (ours.float() - ref.float()).abs().max()
    elif ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:  # a last bit apart at most
        torch.testing.assert_close(ours.float(), ref.float(), atol=1e-5, rtol=2 ** -7)


def rope_tables(positions: torch.Tensor, d: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE, dtype)[:, None], emb.sin().to(DEVICE, dtype)[:, None]


# ---------------------------------------------------------------------------------------------
# each kernel against torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 100), (33, 576)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_equals_torch(ops, dtype, rows, hidden, with_delta):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = randn(rows, hidden, gen=gen, dtype=dtype, scale=3.0)
    delta = randn(rows, hidden, gen=gen, dtype=dtype) if with_delta else None
    weight = (1 + randn(hidden, gen=gen, dtype=torch.float32, scale=0.2)).to(dtype)
    ref_x, ref_h = TorchOps.add_norm(x.clone(), delta, weight, 1e-6)
    ours_x, ours_h = ops.add_norm(x.clone(), delta, weight, 1e-6)
    assert_matches(ours_x, ref_x, exact=True)  # one rounded add
    assert_matches(ours_h, ref_h, exact=dtype == torch.bfloat16 and BF16_EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 4, 2, 16), (5, 9, 3, 64),
                                                   (17, 12, 2, 128)])
def test_rope_in_place_equals_torch(ops, dtype, rows, heads, kv_heads, d):
    """q and k rotated in the fused product itself; v untouched; positions far apart."""
    gen = torch.Generator().manual_seed(rows * heads)
    qkv = randn(rows, (heads + 2 * kv_heads) * d, gen=gen, dtype=dtype)
    cos, sin = rope_tables(torch.arange(rows) * 97 + 3, d, dtype)
    ref = TorchOps.rope(qkv.clone(), heads, kv_heads, cos, sin)
    ours = ops.rope(fused := qkv.clone(), heads, kv_heads, cos, sin)
    for a, b in zip(ours, ref):
        assert_matches(a, b, exact=True)  # products and sums rounded as torch's
    assert ours[0].data_ptr() == fused.data_ptr(), "rotated where the product wrote q"
    assert torch.equal(fused[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 4, 2, 16), (6, 9, 3, 64)])
def test_rope_writes_k_and_v_to_their_slots_as_index_copy(ops, dtype, rows, heads, kv_heads, d):
    """With a paged cache given, the rotated k rows and the v rows land in their (shuffled)
    slots, as torch's index_copy_ puts them; no other slot changes."""
    gen = torch.Generator().manual_seed(rows + d)
    qkv = randn(rows, (heads + 2 * kv_heads) * d, gen=gen, dtype=dtype)
    cos, sin = rope_tables(torch.arange(rows) + 11, d, dtype)
    slots = torch.randperm(40, generator=gen)[:rows].to(DEVICE)
    caches = {}
    for name, impl in (("torch", TorchOps), ("triton", ops)):
        k_cache = randn(40, kv_heads, d, gen=torch.Generator().manual_seed(5), dtype=dtype)
        v_cache = torch.zeros(40, kv_heads, d, device=DEVICE, dtype=dtype)
        q, k, v = impl.rope(qkv.clone(), heads, kv_heads, cos, sin, (k_cache, v_cache, slots))
        caches[name] = (q, k, v, k_cache, v_cache)
    for a, b in zip(caches["triton"], caches["torch"]):
        assert_matches(a, b, exact=True)
    assert torch.equal(caches["triton"][3][slots], caches["triton"][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 128), (6, 1000), (3, 2304)])
def test_silu_mul_equals_torch(ops, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = randn(rows, 2 * inter, gen=gen, dtype=dtype, scale=4.0)
    assert_matches(ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up),
                   exact=dtype == torch.bfloat16 and BF16_EXACT)


def test_no_rows_and_wrong_layouts(ops):
    empty = torch.zeros(0, 64, device=DEVICE)
    assert ops.add_norm(empty, None, torch.ones(64, device=DEVICE), 1e-6)[1].shape == (0, 64)
    assert ops.silu_mul(torch.zeros(0, 128, device=DEVICE)).shape == (0, 64)
    with pytest.raises(AssertionError, match="contiguous"):
        ops.silu_mul(torch.zeros(128, 4, device=DEVICE).t())
    with pytest.raises(AssertionError, match="float32 or bfloat16"):
        ops.silu_mul(torch.zeros(2, 8, device=DEVICE, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# the whole decoder
def tiny_model(kind: str, dtype: torch.dtype):
    """A 3-layer Qwen2 (GQA, q/k/v biases) or Llama of random weights."""
    common = dict(vocab_size=384, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=True)
    torch.manual_seed(1)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_(0.0, 0.5)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.eval().to(DEVICE, dtype)


def causal_attend(k_seen: list, v_seen: list):
    """attend over the rows so far, causally (one sequence): keeps each layer's K/V."""
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_seen[layer], v_seen[layer] = k.clone(), v.clone()
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    return attend


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_with_fused_ops_equals_torch_ops(kind, dtype):
    """Every row's logits, final hidden states and greedy token, and every layer's K/V."""
    model = tiny_model(kind, dtype)
    leans = {name: LeanDecoder(model, kind, ops=name) for name in ("torch", "triton")}
    assert leans["torch"].ops is TorchOps and leans["triton"].ops.name == "triton"
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 384, (23,), generator=gen).to(DEVICE)
    positions = torch.arange(23, device=DEVICE)
    rows = torch.tensor([0, 5, 22], device=DEVICE)
    out = {}
    for name, lean in leans.items():
        k_seen, v_seen = [None] * 3, [None] * 3
        hidden = lean.run(tokens, positions, causal_attend(k_seen, v_seen), rows)
        out[name] = (hidden, lean.logits(hidden), k_seen, v_seen)
    (h_ref, l_ref, k_ref, v_ref), (h, logits, k, v) = out["torch"], out["triton"]
    tol = {"atol": 1e-4, "rtol": 0} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(h.float(), h_ref.float(), **tol)
    torch.testing.assert_close(logits, l_ref, **tol)
    if dtype == torch.float32 or BF16_EXACT:
        assert torch.equal(logits.argmax(-1), l_ref.argmax(-1))
    for a, b in zip(k + v, k_ref + v_ref):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_pruned_run_adds_the_last_layers_output_first():
    """Early pruning after layer 2 sees the residual stream with layer 1's MLP output added,
    both ops the same: kept rows' hidden states agree."""
    model = tiny_model("qwen2", torch.float32)
    seen = {}

    def keep(name):
        def fn(x: torch.Tensor) -> torch.Tensor:
            seen[name] = x.clone()
            return torch.arange(x.shape[0], device=x.device) % 2 == 0
        return fn

    tokens = torch.arange(10, device=DEVICE) * 7
    positions = torch.arange(10, device=DEVICE)
    hidden = {}
    for name in ("torch", "triton"):
        lean = LeanDecoder(model, "qwen2", ops=name)
        hidden[name] = lean.run(tokens, positions, causal_attend([None] * 3, [None] * 3),
                                torch.tensor([0, 4, 8], device=DEVICE), prune=(2, keep(name)))
    torch.testing.assert_close(seen["triton"], seen["torch"], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-4, rtol=0)


def test_bucketed_stream_with_fused_ops_is_the_torch_targets_greedy_stream():
    """The verify step as a GPU runs it (padded buckets, Triton attention, fused ops; on CUDA
    replayed from graphs, float32 without TF32) gives the tokens the torch-ops target decodes
    one row at a time."""
    from test_step_graphs import bucketed, greedy_reference, stream, tiny_qwen2_lean

    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine

    fused, reference = tiny_qwen2_lean(DEVICE.type), tiny_qwen2_lean(DEVICE.type)
    fused.ops, reference.ops = decoder_ops.select("triton", DEVICE), TorchOps
    limits = EngineLimits(kv_budget_tokens=512, block_size=8, graph_rows=16)
    engine = VerifierEngine(fused, limits=limits)
    if DEVICE.type == "cpu":
        bucketed(engine, 16)
    outputs, _, seen = stream(engine, fused)
    assert outputs == {rid: greedy_reference(reference, engine.requests[rid].tokens[:n],
                                             len(outputs[rid])) for rid, n in (("x", 20),
                                                                               ("y", 35))}
    assert len(seen - {0}) >= 3


# ---------------------------------------------------------------------------------------------
# choosing them
def test_auto_is_triton_on_cuda_only():
    assert decoder_ops.select("auto", torch.device("cpu")) is TorchOps
    assert decoder_ops.select("auto", torch.device("cuda")).name == "triton"
    with pytest.raises(ValueError, match="expected one of auto, torch, triton"):
        decoder_ops.select("fused", torch.device("cpu"))


def test_triton_ops_on_the_cpu_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need CUDA"):
        decoder_ops.select("triton", torch.device("cpu"))
    with pytest.raises(SettingsError, match="decoder_ops=triton runs its kernels on CUDA"):
        check(Settings(device="cpu", decoder_ops="triton"))
    assert check(Settings(device="cpu", decoder_ops="torch")).type == "cpu"
