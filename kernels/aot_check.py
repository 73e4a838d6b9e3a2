"""Compiles every Triton kernel of the package for a CUDA target WITHOUT a GPU.

The interpreter (TRITON_INTERPRET=1, how the tests run them here) executes kernels as numpy and
checks much less than the compiler: global variables, dtype promotion, tl.dot shapes, shared
memory size. This runs the real pipeline (frontend, MLIR, ptxas from the triton wheel) so a
CPU-only machine still proves the GPU path compiles. Slow (about 7 s per variant, cached in
~/.triton/cache afterwards), so it is a developer command, not part of the test suite:

    env -u TRITON_INTERPRET .venv/bin/python -m specmesh_kernels.aot_check [--arch 80]
"""
from __future__ import annotations

import argparse
import os

ATTN_STRIDES = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ot", "stride_oc",
                "stride_oh", "stride_lt", "stride_lc", "stride_lh"]
MERGE_STRIDES = ["stride_vt", "stride_vc", "stride_vh", "stride_st", "stride_sc", "stride_sh",
                 "stride_ot", "stride_oh", "stride_lt", "stride_lh"]


def _variants(head_dim: int):
    """(kernel name, signature, constexprs) for every variant the wrappers launch on CUDA."""
    from specmesh_kernels import triton_kernels as tk
    import torch

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for dt, torch_dt in torch_dtypes.items():
        block_m, block_n, block_d = tk.block_sizes(torch.device("cuda"), torch_dt, head_dim)
        for write_lse in (False, True):
            sig = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}",
                   "O": "*fp32" if write_lse else f"*{dt}", "LSE": "*fp32", "SLOTS": "*i64",
                   "MASK": "*u8", "ITEMS": "*i32", **{n: "i32" for n in ATTN_STRIDES},
                   "scale_log2": "fp32"}
            consts = dict(HEAD_DIM=head_dim, GROUP=4, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=block_d, WRITE_LSE=write_lse,
                          PRECISION="ieee" if dt == "fp32" else None, DOT_F32=False)
            yield tk.tree_attn_kernel, sig, consts
    sig = {"V": "*fp32", "S": "*fp32", "O": "*bf16", "LSE": "*fp32", "n_rows": "i32",
           "C": "i32", "H": "i32", **{n: "i32" for n in MERGE_STRIDES}}
    yield tk.merge_states_kernel, sig, dict(HEAD_DIM=head_dim, BLOCK_R=16, BLOCK_D=head_dim)
    sig = {"K": "*bf16", "V": "*bf16", "SRC": "*i64", "DST": "*i64", "R": "i32",
           "stride_kl": "i64", "stride_ks": "i32", "width": "i32"}
    yield tk.compact_kernel, sig, dict(BLOCK=1024)
    yield from _decoder_variants(head_dim)


def _decoder_variants(head_dim: int):
    """The decoder's fused elementwise kernels (decoder_triton.py) in fp32 and bf16, with and
    without the delta / the KV store, at Qwen2.5-1.5B's sizes."""
    from specmesh_kernels import decoder_triton as dk

    for dt in ("fp32", "bf16"):
        flags = dict(ROUND=dt == "bf16", BITS=False)
        for has_delta in (False, True):
            sig = {"X": f"*{dt}", "D": f"*{dt}", "W": f"*{dt}", "Y": f"*{dt}",
                   **{n: "i32" for n in ("stride_x", "stride_d", "stride_y", "n")},
                   "eps": "fp32"}
            yield dk.add_rms_norm_kernel, sig, dict(HAS_DELTA=has_delta, **flags, BLOCK=2048)
        for store in (False, True):
            sig = {"QK": f"*{dt}", "COS": f"*{dt}", "SIN": f"*{dt}", "KC": f"*{dt}",
                   "VC": f"*{dt}", "SLOTS": "*i64",
                   **{n: "i32" for n in ("stride_t", "stride_h", "stride_ct", "stride_st",
                                         "stride_ks", "stride_vs", "n_heads", "heads")}}
            yield dk.rope_kernel, sig, dict(HALF=head_dim // 2, BLOCK_H=16,
                                            BLOCK_J=head_dim // 2, BLOCK_V=256,
                                            V_WIDTH=2 * head_dim, STORE=store, **flags)
        sig = {"GU": f"*{dt}", "OUT": f"*{dt}", "stride_g": "i32", "stride_o": "i32", "n": "i32"}
        yield dk.silu_mul_kernel, sig, dict(**flags, BLOCK=dk.SILU_BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=80, help="CUDA compute capability, e.g. 80")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    for fn, sig, consts in _variants(args.head_dim):
        sig = {**sig, **{name: "constexpr" for name in consts}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=target, options={"enable_fp_fusion": False})
        print(f"{fn.__name__:22s} sm_{args.arch} shared={compiled.metadata.shared:6d} B  "
              f"{ {k: v for k, v in consts.items() if k.startswith(('BLOCK', 'WRITE'))} }")


if __name__ == "__main__":
    main()
