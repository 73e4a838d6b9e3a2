"""One layer's tree attention on a GPU: the Triton kernel, the triton backend's attend (split-KV
beyond SPLIT_KV_MIN positions) and the torch backend's, microseconds per call on a verifier-like
batch; `--sweep`: where the split-KV path pays (docs/benchmarks/scripts.md).

    python -m bench.cuda_attention [--json results.json]
    python -m bench.cuda_attention --sweep [--json sweep.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import math

import torch

from specmesh_kernels.backend import SPLIT_KV_MIN, tree_attention_split
from specmesh_kernels.metadata import TreeBatch
from specmesh_kernels.tree_attention import (tree_attention_ref, tree_attention_torch,
                                             tree_attention_triton)

SHAPES = {"SmolLM2-135M (9/3 x 64)": (9, 3, 64), "Qwen2.5-1.5B (12/2 x 128)": (12, 2, 128)}
ROWS = [16, 1, 9, 5, 16, 1, 12, 3]  # query rows of the 8 segments
PREFIXES = [1024 - n for n in ROWS]  # about 1024 positions each, including the new rows
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)  # --sweep: the long segments' KV length
CHUNKS = (512, 1024, 2048, 4096)  # --sweep: split-KV chunk sizes
SHORT = 256  # --sweep: KV length of the seven short segments of a skewed batch
HBM_BYTES = 128 << 20  # --sweep: K/V bytes cycled through per timed call (L2 is 50 MB)


def make_batch(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str,
               seed: int = 0, rows: list[int] = ROWS, kv_lens: list[int] | None = None
               ) -> tuple:
    """attend's arguments: random trees (parent a random earlier node), shuffled slots; segment
    s has rows[s] new rows and kv_lens[s] positions in all (default: PREFIXES + rows)."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for n in rows:
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            p = int(torch.randint(-1, i, (1,), generator=g))
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        masks.append(mask.reshape(-1))
    kv_lens = kv_lens or [p + n for p, n in zip(PREFIXES, rows)]
    num_slots = sum(kv_lens) + 64
    slots = torch.randperm(num_slots, generator=g)[:sum(kv_lens)]

    def indptr(sizes):
        return torch.tensor([0] + sizes).cumsum(0).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return (rand(sum(rows), heads, dim), rand(num_slots, kv_heads, dim),
            rand(num_slots, kv_heads, dim), indptr(rows), indptr(kv_lens), slots.to(device),
            torch.cat(masks).to(device), indptr([n * n for n in rows]), 1.0 / math.sqrt(dim))


def time_us(fn, warmup: int, iters: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def time_graph_us(fn, iters: int, repeats: int) -> float:
    """Device time per call: `iters` calls of fn (already warm) captured in one CUDA graph,
    replayed; best of `repeats`. NaN if capture fails."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
    except RuntimeError as e:
        print(f"  (graph capture failed: {e})")
        return float("nan")
    return time_us(graph.replay, 0, 1, repeats) / iters


def sweep(args) -> None:
    """The --sweep table (see the module docstring); JSON rewritten after every row."""
    results = []
    names = ["one launch"] + [f"split {c}" for c in CHUNKS]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 8 segments, bf16; "
          "us per call, eager / graph")
    print("| shape | batch | context | " + " | ".join(names) + " | max err |")
    print("|---|---|---:|" + "---:|" * len(names) + "---:|")
    for ctx in CONTEXTS:
        batches = {"uniform decode": ([1] * 8, [ctx] * 8), "uniform tree": (ROWS, [ctx] * 8),
                   "skewed decode": ([1] * 8, [ctx] + [SHORT] * 7),
                   "skewed tree": (ROWS, [ctx] + [SHORT] * 7)}
        for shape, (heads, kv_heads, dim) in SHAPES.items():
            for kind, (rows, kv_lens) in batches.items():
                batch = make_batch(heads, kv_heads, dim, torch.bfloat16, "cuda", rows=rows,
                                   kv_lens=kv_lens)
                meta = TreeBatch.build(*batch[3:8])
                k, v = batch[1], batch[2]
                layers = max(2, -(-HBM_BYTES // (2 * k.numel() * k.element_size())))
                caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v))
                                     for _ in range(layers - 1)]

                def forward(attend, batch=batch, caches=caches, meta=meta):
                    for kc, vc in caches:
                        attend(batch[0], kc, vc, *batch[3:], meta=meta)

                impls = {"one launch": tree_attention_triton}
                for c in CHUNKS:
                    if max(kv_lens) > c:  # else the backend makes the one launch
                        impls[f"split {c}"] = functools.partial(tree_attention_split,
                                                                chunk_size=c, min_kv=0)
                expected = tree_attention_ref(*batch).float()
                errors = {n: (fn(*batch, meta=meta).float() - expected).abs().max().item()
                          for n, fn in impls.items()}
                iters = max(1, -(-args.attends // layers))
                eager, graph = {}, {}
                for n, fn in impls.items():
                    call = functools.partial(forward, fn)
                    eager[n] = time_us(call, 2, iters, args.repeats) / layers
                    graph[n] = time_graph_us(call, iters, args.repeats) / layers
                row = {"shape": shape, "batch": kind, "context": ctx, "rows": rows,
                       "kv_lens": kv_lens, "layers": layers, "eager_us": eager,
                       "graph_us": graph, "max_abs_error": errors}
                results.append(row)
                cells = [f"{eager[n]:.1f} / {graph[n]:.1f}" if n in eager else "-"
                         for n in names]
                print(f"| {shape} | {kind} | {ctx} | " + " | ".join(cells) +
                      f" | {max(errors.values()):.1e} |")
                del caches
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name(),
                                   "torch": torch.__version__, "triton": triton_version(),
                                   "chunks": CHUNKS, "results": results}, f, indent=2)


def triton_version() -> str:
    import triton

    return triton.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true",
                        help="the split-KV sweep (contexts x batches x chunk sizes)")
    parser.add_argument("--attends", type=int, default=64,
                        help="--sweep: attend calls per timed repeat (--warmup/--iters unused)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    if args.sweep:
        return sweep(args)
    results = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 8 segments, rows {ROWS}, "
          f"context {PREFIXES[0] + ROWS[0]} each, bf16; us per call")
    print(f"| shape | triton kernel | triton backend (split beyond {SPLIT_KV_MIN}) | torch backend "
          "| max err |")
    print("| --- | --- | --- | --- | --- |")
    for name, (heads, kv_heads, dim) in SHAPES.items():
        batch = make_batch(heads, kv_heads, dim, torch.bfloat16, "cuda")
        meta = TreeBatch.build(*batch[3:8])
        impls = {"triton kernel": lambda: tree_attention_triton(*batch, meta=meta),
                 "triton backend": lambda: tree_attention_split(*batch, meta=meta),
                 "torch backend": lambda: tree_attention_torch(*batch, meta=meta)}
        expected = tree_attention_ref(*(t.cpu() if torch.is_tensor(t) else t for t in batch))
        errors = {k: (fn().float().cpu() - expected.float()).abs().max().item()
                  for k, fn in impls.items()}
        row = {"shape": name, **{k: time_us(fn, args.warmup, args.iters, args.repeats)
                                 for k, fn in impls.items()},
               "max_abs_error": errors}
        results.append(row)
        print(f"| {name} | {row['triton kernel']:.1f} | {row['triton backend']:.1f} | "
              f"{row['torch backend']:.1f} | {max(errors.values()):.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": ROWS, "prefixes": PREFIXES, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
