"""What a verify step costs per extra row, by linear-layer kernels (kernels/linear.py).

One forward of n new tokens over a KV cache of `--context` tokens, the shape of a verify step
(root + n - 1 tree nodes), for each `--linear` backend and dtype: median milliseconds and the
ratio to n = 1 (a plain decoding step). `int4` (float32 only) runs every linear layer through
torch's CPU int4 kernel for every row count, as a target would have to (its results must not
depend on how many rows a call has). The ratio is what speculation must beat: a step of n rows
pays off only when it emits more than ratio(n) tokens on average.

    python -m bench.linear                                    # Qwen2.5-Coder-1.5B, fp32 + bf16
    python -m bench.linear --model smollm2-135m --dtypes float32 --rows 1,8
    python -m bench.linear --dtypes float32 bfloat16 --linear onednn int4
Writes bench/results/linear-<model>.json and .md (run it alone on the machine).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from bench.batch import header
from bench.run import save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_kernels.linear import (fp16_supports, int4_supports, onednn_supports,
                                     quantize_linears)


def step_ms(model, context: int, rows: list[int], reps: int) -> dict[int, float]:
    """Median ms of a forward of n tokens after `context` cached tokens, per n in `rows` (one
    prefill; the cache is cropped back to the prefix after every step)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    out = {}
    with torch.inference_mode():
        model(torch.randint(vocab, (1, context), generator=gen), past_key_values=cache,
              use_cache=True)
        for n in tqdm(rows, desc="rows", leave=False):
            x = torch.randint(vocab, (1, n), generator=gen)
            pos = torch.arange(context, context + n).unsqueeze(0)
            times = []
            for i in range(reps + 1):
                start = time.perf_counter()
                model(x, past_key_values=cache, position_ids=pos, use_cache=True)
                elapsed = time.perf_counter() - start
                cache.crop(-n)  # back to the prefix (transformers 5: crop(-n) drops n tokens)
                if i:  # the first call warms the shape up
                    times.append(elapsed)
            out[n] = statistics.median(times) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--linear", nargs="+", default=["torch", "onednn", "fp16"],
                        choices=["torch", "onednn", "fp16", "int4"])
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="new tokens per forward")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the step")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    path = models.resolve(args.model, Settings().cache_dir)
    results = []
    for dtype_name in args.dtypes:
        dtype = models.resolve_dtype(dtype_name)
        for linear in args.linear:
            if linear == "onednn" and (reason := onednn_supports(dtype)):
                print(f"{dtype_name} onednn: not on this CPU ({reason})")
                continue
            if linear == "fp16" and (reason := fp16_supports() or (
                    None if dtype == torch.bfloat16 else "bf16 models only")):
                print(f"{dtype_name} fp16: skipped ({reason})")
                continue
            if linear == "int4" and (reason := int4_supports() or (
                    None if dtype == torch.float32 else "float32 models only")):
                print(f"{dtype_name} int4: skipped ({reason})")
                continue
            model = models.load_model(path, dtype, linear="torch" if linear == "int4" else linear)
            if linear == "int4":
                quantize_linears(model, "int4", dense_rows=None)
            print(f"{dtype_name} {linear} ...", flush=True)
            ms = step_ms(model, args.context, rows, args.reps)
            results.append({"dtype": dtype_name, "linear": linear, "ms": ms})
            del model
    report = {"model": args.model, "context": args.context, "reps": args.reps, "rows": rows,
              "results": results}
    lines = [header(f"verify-step cost by linear kernels, {args.model}, context {args.context}",
                    False), "",
             "| dtype | linear | " + " | ".join(f"{n} rows" for n in rows) + " |",
             "|---|---|" + "---:|" * len(rows)]
    for r in results:
        one = r["ms"][rows[0]]
        cells = [f"{r['ms'][n]:.0f} ms ({r['ms'][n] / one:.2f}x)" for n in rows]
        lines.append(f"| {r['dtype']} | {r['linear']} | " + " | ".join(cells) + " |")
    save_report(f"linear-{args.model}", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
