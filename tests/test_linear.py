"""kernels/onednn.py, fp16.py and linear_rules.pack_linears: packed linear layers against torch's
linear (the reference)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from specmesh_kernels.fp16 import Fp16Linear, fp16_row_blocks, fp16_supports, fp16_weight_error
from specmesh_kernels.linear_rules import pack_linears
from specmesh_kernels.onednn import PackedLinear, onednn_supports
from specmesh_services.common import models

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
    else:  # e.g. AVX2 without AVX512-BF16: onednn says why it cannot, auto takes FBGEMM's
        with pytest.raises(RuntimeError, match="cannot run torch.bfloat16"):
            pack_linears(model, "onednn")
        expected = nn.Linear if fp16_supports() is not None else Fp16Linear
        assert pack_linears(model, "auto") == (expected is Fp16Linear)
        assert type(model[0]) is expected


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


needs_fp16 = pytest.mark.skipif(fp16_supports() is not None,
                                reason="FBGEMM's fp16-weight linear does not run here")


def bf16_reference(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The float32 product of bf16-rounded weights and inputs: the exact products torch's bf16
    linear accumulates, before its output is rounded to bf16."""
    bias = None if linear.bias is None else linear.bias.float()
    return nn.functional.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), bias)


@needs_fp16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576)])
def test_fp16_linear_computes_the_bf16_product(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    fp16 = Fp16Linear(linear)
    with torch.inference_mode():
        for rows in (1, 2, 5, 6, 7, 13, 64):
            x = torch.randn(rows, shape[0])
            # float32 in, float32 out: the same exact products summed in another order
            torch.testing.assert_close(fp16(x.bfloat16().float()), bf16_reference(linear, x),
                                       rtol=1e-5, atol=1e-5)
            # bf16 in, bf16 out: what torch's bf16 linear gives, to bf16's last bit
            got = fp16(x.bfloat16())
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, linear(x.bfloat16()), rtol=2 ** -7, atol=1e-2)
        x = torch.randn(2, 5, shape[0]).bfloat16()  # [batch, seq, features]
        torch.testing.assert_close(fp16(x).float(), bf16_reference(linear, x),
                                   rtol=2 ** -7, atol=1e-2)
        x = torch.randn(shape[0], 3).bfloat16().float().t()  # non-contiguous input
        assert not x.is_contiguous()
        torch.testing.assert_close(fp16(x), bf16_reference(linear, x), rtol=1e-5, atol=1e-5)


@needs_fp16
def test_fp16_rows_agree_across_call_sizes():
    """Unlike oneDNN's float32 product, FBGEMM's depends in the last float32 bits on how the
    call's rows fall into its blocks (6 rows on AVX2): a verify row and a plain step's row may
    differ by a bf16 ulp after rounding (as on bf16 hardware: tests/test_bf16_ties.py)."""
    torch.manual_seed(0)
    fp16 = Fp16Linear(nn.Linear(576, 1536, bias=False).to(torch.bfloat16))
    x = torch.randn(16, 576)
    with torch.inference_mode():
        full = fp16(x)
        for rows in (1, 2, 6, 7, 12):
            torch.testing.assert_close(fp16(x[:rows]), full[:rows], rtol=1e-6, atol=1e-5)


@needs_fp16
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 49152)])
def test_fp16_row_stable_rows_do_not_depend_on_the_call_size(shape):
    """`row_stable`: a call's rows padded so that its last block runs a kernel that sums in the
    full block's order (`fp16_row_blocks`); every row then has one result for any call size."""
    if fp16_row_blocks() is None:
        pytest.skip("no padding makes FBGEMM's fp16 rows stable here")
    torch.manual_seed(0)
    linear = nn.Linear(*shape, bias=False).to(torch.bfloat16)
    plain, stable = Fp16Linear(linear), Fp16Linear(linear, row_stable=True)
    x = torch.randn(40, shape[0])
    with torch.inference_mode():
        full = stable(x)
        torch.testing.assert_close(full, plain(x), rtol=1e-6, atol=1e-5)
        for start in (0, 3):
            for rows in range(1, 40 - start):
                part = stable(x[start:start + rows])
                assert torch.equal(part, full[start:start + rows]), (start, rows)


@needs_fp16
def test_fp16_refuses_weights_outside_float16():
    linear = nn.Linear(4, 2, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight[0, 0] = 1e6
    assert "exceeds float16's range" in fp16_weight_error(linear.weight)
    with pytest.raises(ValueError, match="exceeds float16's range"):
        Fp16Linear(linear)
    model = nn.Sequential(linear)
    with pytest.raises(RuntimeError, match="linear backend 'fp16' cannot run"):
        pack_linears(model, "fp16")
    if onednn_supports(torch.bfloat16) is not None:  # auto falls back to torch's linear
        assert pack_linears(model, "auto") == 0 and type(model[0]) is nn.Linear


@needs_fp16
def test_pack_linears_fp16_backend():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(3, 8).bfloat16()
    with torch.inference_mode():
        ref = model(x)
        assert pack_linears(model, "fp16") == 2 and isinstance(model[2], Fp16Linear)
        torch.testing.assert_close(model(x), ref, rtol=2 ** -7, atol=1e-2)
    with pytest.raises(RuntimeError, match="fp16 holds bf16 weights"):
        pack_linears(nn.Sequential(nn.Linear(8, 4)), "fp16")


@needs_fp16
def test_real_model_bf16_greedy_matches_torch_linears(target_path, tokenizer):
    """SmolLM2 in bf16 with Fp16Linear layers decodes like transformers' own bf16 linears."""
    fast = models.load_model(target_path, torch.bfloat16, linear="fp16")
    stock = models.load_model(target_path, torch.bfloat16, linear="torch")
    assert isinstance(fast.lm_head, Fp16Linear) and type(stock.lm_head) is nn.Linear
    ids = torch.tensor([tokenizer("def fibonacci(n):").input_ids])
    with torch.inference_mode():
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                  pad_token_id=tokenizer.eos_token_id)
        assert fast.generate(ids, **kw).tolist() == stock.generate(ids, **kw).tolist()


PROBE_THREADS = """
import os, torch
from specmesh_kernels.fp16 import fp16_supports
from specmesh_kernels.int4 import int4_supports
from specmesh_kernels.onednn import onednn_supports
from specmesh_services.common import models
tasks = lambda: len(os.listdir("/proc/self/task"))
before, threads = tasks(), torch.get_num_threads()
fp16_supports(), int4_supports(), onednn_supports(torch.bfloat16), models.resolve_dtype("auto")
print(before, tasks(), threads, torch.get_num_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_kernel_probes_start_no_openmp_team():
    """A probe in the event-loop thread must not give it an OpenMP team: with more OpenMP
    threads than cores libgomp stops spinning at barriers, and llama.cpp's decode in the
    compute thread ran 1.45x slower."""
    out = subprocess.run([sys.executable, "-c", PROBE_THREADS], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, threads, threads_after = map(int, out)
    assert after == before, "a probe started threads"
    assert threads_after == threads, "a probe left torch's thread count changed"
