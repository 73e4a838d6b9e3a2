"""What a verify step costs per extra row, by linear-layer kernels (kernels/linear.py).

One forward of n new tokens over a KV cache of `--context` tokens, the shape of a verify step
(root + n - 1 tree nodes), for each `--linear` backend and dtype: median milliseconds and the
ratio to n = 1 (a plain decoding step). `int4` (float32 only) runs every linear layer through
torch's CPU int4 kernel for every row count, as a target would have to (its results must not
depend on how many rows a call has). `native` (float32 only) serves the model as a native
target does (`native_int4`: the GGUF's 4-bit layers int4, the others as `--native-rest`). The
ratio is what speculation must beat: a step of n rows pays off only when it emits more than
ratio(n) tokens on average. The configurations are loaded side by side and timed in turns, so
their ratios hold on a shared machine.

    python -m bench.linear                                    # Qwen2.5-Coder-1.5B, fp32 + bf16
    python -m bench.linear --model smollm2-135m --dtypes float32 --rows 1,8
    python -m bench.linear --configs float32/native bfloat16/onednn --generate 64
    python -m bench.linear --layers          # the non-4-bit layers of a native target, by form
Writes bench/results/linear-<model>.json and .md (layers-<model> with --layers).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from bench.batch import header
from bench.run import save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.prompts import chat_ids, mtbench_questions
from specmesh_kernels.linear import (Fp16Linear, PackedLinear, RowStableLinear, fp16_supports,
                                     int4_lattice, int4_supports, native_int4, onednn_supports,
                                     quantize_linears)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def timed_steps(models_: dict[str, nn.Module], context: int, rows: list[int], reps: int,
                stat=statistics.median, clock=time.perf_counter) -> dict[str, dict[int, float]]:
    """`stat` (median, or min on a busy machine) of the ms of a forward of n tokens after
    `context` cached tokens, per model and n in `rows`; the models take turns call by call (one
    prefill each; the cache is cropped back to the prefix after every step, the first call of
    each shape is a warm-up)."""
    vocab = next(iter(models_.values())).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (1, context), generator=gen)
    steps = {n: torch.randint(vocab, (1, n), generator=gen) for n in rows}
    caches = {}
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in rows} for k in models_}
    with torch.inference_mode():
        for label, model in models_.items():
            caches[label] = DynamicCache()
            model(prefix, past_key_values=caches[label], use_cache=True)
        for rep in tqdm(range(reps + 1), desc="reps", leave=False):
            for n in rows:
                pos = torch.arange(context, context + n).unsqueeze(0)
                for label, model in models_.items():
                    start = clock()
                    model(steps[n], past_key_values=caches[label], position_ids=pos,
                          use_cache=True)
                    elapsed = clock() - start
                    caches[label].crop(-n)  # back to the prefix (transformers 5: drops n tokens)
                    if rep:
                        times[label][n].append(elapsed)
    return {k: {n: stat(t) * 1e3 for n, t in v.items()} for k, v in times.items()}


def step_ms(model: nn.Module, context: int, rows: list[int], reps: int) -> dict[int, float]:
    """Median ms of a forward of n tokens after `context` cached tokens, per n in `rows`, for
    one model (bench.agreement's verify cost)."""
    return timed_steps({"model": model}, context, rows, reps)["model"]


def generate_tps(models_: dict[str, nn.Module], prompts: list[list[int]], tokens: int,
                 eos: list[int], rounds: int = 1, clock=time.perf_counter) -> dict[str, float]:
    """Greedy plain decoding tok/s (transformers `generate`, `tokens` new tokens per prompt,
    prefill included), the models taking turns prompt by prompt; the median over `rounds`
    passes over the prompts."""
    rates: dict[str, list[float]] = {k: [] for k in models_}
    with torch.inference_mode():
        for _ in range(rounds):
            spent = dict.fromkeys(models_, 0.0)
            for ids in prompts:
                x = torch.tensor([ids])
                for label, model in models_.items():
                    start = clock()
                    out = model.generate(x, max_new_tokens=tokens, min_new_tokens=tokens,
                                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
                    spent[label] += clock() - start
                    assert out.shape[1] - len(ids) == tokens
            for label, seconds in spent.items():
                rates[label].append(tokens * len(prompts) / seconds)
    return {k: statistics.median(r) for k, r in rates.items()}


def load(path, dtype_name: str, linear: str) -> nn.Module:
    dtype = models.resolve_dtype(dtype_name)
    if linear.startswith("native"):
        model = models.load_model(path, dtype, linear="torch")
        rest = linear.partition(":")[2]
        native_int4(model, DTYPES[rest]) if rest else native_int4(model)
        return model
    model = models.load_model(path, dtype, linear="torch" if linear == "int4" else linear)
    if linear == "int4":
        quantize_linears(model, "int4", dense_rows=None)
    return model


def skip_reason(dtype_name: str, linear: str) -> str | None:
    dtype = models.resolve_dtype(dtype_name)
    if linear == "onednn":
        return onednn_supports(dtype)
    if linear == "fp16":
        return fp16_supports() or (None if dtype == torch.bfloat16 else "bf16 models only")
    if linear == "int4" or linear.startswith("native"):
        return int4_supports() or (None if dtype == torch.float32 else "float32 models only")
    return None


# ---------------------------------------------------------------------------------------------
# the layers a native target does not hold in 4 bits


def layer_forms(linear: nn.Linear) -> dict[str, nn.Module]:
    """The forms a target's non-4-bit layer could take: float32 in and out for all."""
    def bf16_torch(x, w=linear.weight.detach().bfloat16()):
        return nn.functional.linear(x.bfloat16(), w).float()

    stable = RowStableLinear(linear, torch.bfloat16)  # oneDNN, or FBGEMM fp16 (AVX2)
    forms = {"float32 torch": linear, "float32 oneDNN": PackedLinear(linear, keep_dense=False),
             "bf16 torch": bf16_torch}
    if isinstance(stable.packed, PackedLinear):
        forms["bf16 oneDNN"] = stable.packed
    else:
        copy = nn.Linear(linear.in_features, linear.out_features, bias=False)
        copy.weight.data = linear.weight.detach().bfloat16()
        forms["bf16 as fp16, FBGEMM"] = Fp16Linear(copy)
        forms["bf16 as fp16, FBGEMM, rows padded"] = stable.packed
    return {**forms, "float32 RowStable": RowStableLinear(linear, torch.float32),
            "bf16 RowStable": stable}


def row_invariant(layer, features: int, most: int = 64) -> bool:
    """Whether every row of calls of 1..`most` rows (prefixes and windows) equals the row
    computed in a call of `most` rows."""
    x = torch.randn(most, features, generator=torch.Generator().manual_seed(0))
    cast = (lambda t: t.bfloat16()) if isinstance(layer, PackedLinear) and \
        layer.weight_dtype == torch.bfloat16 else (lambda t: t)
    ref = layer(cast(x))
    calls = [(i, 1) for i in range(most)] + [(0, n) for n in range(2, most + 1)]
    calls += [(i, n) for i in range(0, most, 7) for n in (2, 5, 9, 17, 33) if i + n <= most]
    return all(torch.equal(layer(cast(x[i:i + n])), ref[i:i + n]) for i, n in calls)


def layer_ms(layer, features: int, rows: list[int], reps: int, bf16_in: bool,
             clock=time.perf_counter) -> dict[int, float]:
    x = torch.randn(max(rows), features)
    x = x.bfloat16() if bf16_in else x
    out = {}
    for n in rows:
        xs = x[:n].contiguous()
        layer(xs)
        times = []
        for _ in range(reps):
            start = clock()
            layer(xs)
            times.append(clock() - start)
        out[n] = min(times) * 1e3  # the least disturbed call: layers take ~0.1-50 ms
    return out


def bench_layers(path, rows: list[int], reps: int,
                 clock=time.perf_counter) -> tuple[dict, list[str]]:
    """Per distinct shape of the model's linear weights that are not 4-bit lattice groups: each
    form's fastest ms of `reps` calls by rows and whether its rows are call-size invariant."""
    from safetensors import safe_open

    shapes: dict[tuple[int, int], list[str]] = {}
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if not key.endswith("proj.weight") and key != "lm_head.weight":
                    continue
                weight = f.get_tensor(key)
                if int4_lattice(weight) is None:
                    shape = tuple(weight.shape)
                    shapes.setdefault(shape, []).append(key)
                    tensors.setdefault(shape, (weight, f.get_tensor(key[:-6] + "bias")
                                               if key[:-6] + "bias" in f.keys() else None))
    report, lines = [], ["| layer (out x in, count) | form | row-invariant | "
                         + " | ".join(f"{n} rows" for n in rows) + " |",
                         "|---|---|---|" + "---:|" * len(rows)]
    for shape, keys in shapes.items():
        weight, bias = tensors[shape]
        linear = nn.Linear(shape[1], shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.data = weight
            if bias is not None:
                linear.bias.data = bias
            forms = layer_forms(linear)
        name = keys[0].split(".")[-2]
        for form, layer in tqdm(forms.items(), desc=name, leave=False):
            bf16_in = isinstance(layer, PackedLinear) and layer.weight_dtype == torch.bfloat16
            with torch.inference_mode():
                invariant = row_invariant(layer, shape[1])
                ms = layer_ms(layer, shape[1], rows, reps, bf16_in, clock)
            report.append({"layer": name, "shape": shape, "count": len(keys), "form": form,
                           "row_invariant": invariant, "ms": ms})
            lines.append(f"| {name} ({shape[0]} x {shape[1]}, {len(keys)}) | {form} | "
                         f"{'yes' if invariant else 'no'} | "
                         + " | ".join(f"{ms[n]:.2f} ms" for n in rows) + " |")
    return {"layers": report}, lines


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--linear", nargs="+", default=["torch", "onednn", "fp16"],
                        choices=["torch", "onednn", "fp16", "int4", "native", "native:float32",
                                 "native:bfloat16"],
                        help="native:DTYPE: the non-4-bit layers of a native target in DTYPE")
    parser.add_argument("--configs", nargs="+", metavar="DTYPE/LINEAR",
                        help="these configurations instead of every --dtypes x --linear pair "
                             "(e.g. float32/native bfloat16/onednn)")
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="new tokens per forward")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="of the reps: min is the least disturbed call on a busy machine")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time, steadier than wall time on a shared "
                             "machine with --threads 1 (no thread waits on another)")
    parser.add_argument("--generate", type=int, default=0, metavar="TOKENS",
                        help="also greedy plain decoding tok/s, TOKENS new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="MT-Bench prompts for --generate")
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the prompts for --generate (the median is reported)")
    parser.add_argument("--layers", action="store_true",
                        help="time the forms of the model's non-4-bit layers instead")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    path = models.resolve(args.model, Settings().cache_dir)
    if args.layers:
        report, lines = bench_layers(path, rows, max(args.reps, 20), clock)
        save_report(f"layers-{args.model}", {"model": args.model, "rows": rows,
                                             "clock": args.clock,
                                             "threads": torch.get_num_threads(), **report},
                    "\n".join([header(f"non-4-bit layers of a native {args.model}, fastest of "
                                       f"{max(args.reps, 20)} calls, {args.clock} clock", False),
                                "", *lines]) + "\n")
        return 0
    pairs = ([tuple(c.split("/", 1)) for c in args.configs] if args.configs else
             [(d, linear) for d in args.dtypes for linear in args.linear])
    loaded: dict[str, nn.Module] = {}
    for dtype_name, linear in pairs:
        if reason := skip_reason(dtype_name, linear):
            print(f"{dtype_name} {linear}: skipped ({reason})")
            continue
        print(f"loading {dtype_name} {linear} ...", flush=True)
        loaded[f"{dtype_name} {linear}"] = load(path, dtype_name, linear)
        gc.collect()
    ms = timed_steps(loaded, args.context, rows, args.reps,
                     min if args.stat == "min" else statistics.median, clock)
    tps = {}
    if args.generate:
        tokenizer = models.load_tokenizer(path)
        prompts = [chat_ids(tokenizer, q["turns"][0]) for q in mtbench_questions()[:args.prompts]]
        tps = generate_tps(loaded, prompts, args.generate,
                           models.eos_token_ids(path, tokenizer), args.rounds, clock)
    results = [{"dtype": k.split()[0], "linear": k.split()[1], "ms": ms[k],
                **({"generate_tok_s": tps[k]} if tps else {})} for k in loaded]
    report = {"model": args.model, "context": args.context, "reps": args.reps, "stat": args.stat,
              "clock": args.clock, "threads": torch.get_num_threads(), "rows": rows,
              "generate_tokens": args.generate, "prompts": args.prompts, "rounds": args.rounds,
              "results": results}
    gen_head = f" | greedy tok/s ({args.prompts} x {args.generate})" if tps else ""
    lines = [header(f"verify-step cost by linear kernels, {args.model}, context {args.context}, "
                    f"{args.stat} of {args.reps}, {args.clock} clock", False), "",
             "| dtype | linear | " + " | ".join(f"{n} rows" for n in rows) + gen_head + " |",
             "|---|---|" + "---:|" * (len(rows) + bool(tps))]
    for r in results:
        one = r["ms"][rows[0]]
        cells = [f"{r['ms'][n]:.0f} ms ({r['ms'][n] / one:.2f}x)" for n in rows]
        if tps:
            cells.append(f"{r['generate_tok_s']:.2f}")
        lines.append(f"| {r['dtype']} | {r['linear']} | " + " | ".join(cells) + " |")
    save_report(f"linear-{args.model}", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
