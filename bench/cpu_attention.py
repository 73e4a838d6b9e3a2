"""One layer's attention on the CPU for one request (batch 1), as the verifier calls it: the
torch backend (`tree_attention_torch`) with its lone-request path (`_lone_segment`: two
matmuls over the KV heads) against its generic path (`lone=False`: the padded batch for one
row, SDPA for a tree), over a KV cache whose positions lie in consecutive slots (a lone
request's blocks: read as slices, `TreeBatch.kv_start`) or at shuffled slots (gathered first);
for a plain step (one row) and a chain of drafted rows, per context length. The TreeBatch is
built once, as the verifier builds it once per forward. Microseconds per call: mean of
`--iters` calls, best of `--repeats`.

    python -m bench.cpu_attention                      # SmolLM2-135M's heads (9 / 3 x 64)
    python -m bench.cpu_attention --heads 12 2 128 --dtype bfloat16   # Qwen2.5-1.5B's, bf16
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from specmesh_kernels.metadata import TreeBatch
from specmesh_kernels.tree_attention import tree_attention_torch


def batch(rows: int, context: int, heads: int, kv_heads: int, dim: int, shuffled: bool,
          gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple:
    """Attention inputs of one segment: `context` positions (the last `rows` new, a chain)."""
    slots = 4 * context
    kv = (torch.randperm(slots, generator=gen)[:context] if shuffled
          else torch.arange(context, 2 * context))
    mask = torch.ones(rows, rows, dtype=torch.bool).tril().reshape(-1)
    return (torch.randn(rows, heads, dim, generator=gen).to(dtype),
            torch.randn(slots, kv_heads, dim, generator=gen).to(dtype),
            torch.randn(slots, kv_heads, dim, generator=gen).to(dtype),
            torch.tensor([0, rows]), torch.tensor([0, context]), kv, mask,
            torch.tensor([0, rows * rows]))


def time_us(args: tuple, scale: float, iters: int, repeats: int, lone: bool = True) -> float:
    meta = TreeBatch.build(*args[3:])
    for _ in range(max(10, iters // 20)):
        tree_attention_torch(*args, scale, meta=meta, lone=lone)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            tree_attention_torch(*args, scale, meta=meta, lone=lone)
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                        metavar=("HEADS", "KV_HEADS", "DIM"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="q / K / V dtype [float32: a native target's]")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    heads, kv_heads, dim = args.heads
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"attention of one request, {heads} / {kv_heads} heads x {dim}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, us per call (best of {args.repeats} means of "
          f"{args.iters})\n")
    print("| rows | context | lone, consecutive | lone, shuffled | generic, consecutive | "
          "generic, shuffled | lone / generic (consecutive) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for context in args.contexts:
            us = {(lone, shuffled): time_us(batch(rows, context, heads, kv_heads, dim, shuffled,
                                                  gen, dtype),
                                            dim ** -0.5, args.iters, args.repeats, lone)
                  for lone in (True, False) for shuffled in (False, True)}
            print(f"| {rows} | {context} | " + " | ".join(f"{us[key]:.0f}" for key in us)
                  + f" | {us[True, False] / us[False, False]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
