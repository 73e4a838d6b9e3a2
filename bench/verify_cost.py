"""The verifier's step cost as a function of (batch, tree nodes, context length) and the cost
model fitted to it, the curve the router sizes trees with (SSSD figures 2-3, ProPD's regression;
how it is measured: docs/benchmarks/scripts.md).

    python -m bench.verify_cost                                  # both models, as served
    python -m bench.verify_cost --models smollm2-135m --quick    # smoke run, < 3 min
    python -m bench.verify_cost --tree chain --lengths 256,2048 --batches 1,2,4,8,16
Writes bench/results/verify-cost-<model>-<weights>-<runner>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from bench.batch import MODELS, header, random_tree
from bench.run import RESULTS
from specmesh_services.common.config import Settings
from specmesh_services.common.serving import compute_executor
from specmesh_services.common.tree import TokenTree
from specmesh_services.verifier.cost import VerifyCostModel
from specmesh.v1 import common_pb2, pool_pb2

FULL = {"lengths": "128,512,1024", "batches": "1,4,8", "nodes": "0,1,3,7,15,31,63", "reps": 7}
QUICK = {"lengths": "128,512", "batches": "1,8", "nodes": "0,3,15,63", "reps": 3}
WARMUP = 1  # untimed steps per cell (new shapes)


def build(settings: Settings, batch: int, length: int, nodes: int):
    """The target and an engine sized for `batch` requests of `length` + a tree of `nodes`."""
    from specmesh_services.verifier.server import build_engine, load_target

    rows = batch * (length + nodes + 1)
    settings = settings.with_overrides(**{
        "verifier.batch_size": batch,
        "verifier.max_batch_tokens": max(1024, batch * (nodes + 1)),
        "verifier.kv_budget_tokens": max(16384, rows + batch * 64)})
    lm = load_target(settings)
    if length + nodes + 1 > lm.context_length:
        raise SystemExit(f"{settings.model}: context {lm.context_length} < {length} + {nodes} + 1")
    return lm, build_engine(lm, settings, "bench-verify-cost")


def make_tree(shape: str, n: int, vocab: int, gen: torch.Generator) -> TokenTree:
    if shape == "chain":
        return TokenTree.chain(torch.randint(0, vocab, (n,), generator=gen).tolist())
    return random_tree(n, vocab, gen)


def measure(engine, vocab: int, lengths: list[int], batches: list[int], nodes: list[int],
            reps: int, shape: str, seed: int = 0) -> list[dict]:
    """Median step seconds for every (L, b, n); longest contexts first, so each shorter L is a
    truncation of the KV already there (the prompts share their prefix)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (max(batches), max(lengths)), generator=gen).tolist()
    ids = [f"cost-{j}" for j in range(max(batches))]

    def state(j: int, length: int) -> pool_pb2.RequestState:
        return pool_pb2.RequestState(request_id=ids[j], prompt_ids=tokens[j][:length],
                                     sampling=common_pb2.SamplingParams())

    for j in range(len(ids)):  # prefill once at the longest context (chunked steps, not timed)
        engine.load(state(j, max(lengths)), [])
    while any(r.deferred for r in engine.step([(i, TokenTree()) for i in ids])):
        pass
    cells = []
    grid = [(L, b, n) for L in sorted(lengths, reverse=True) for b in batches for n in nodes]
    for L, b, n in tqdm(grid, desc="verify cost", leave=False):
        samples, stats = [], None
        for rep in range(WARMUP + reps):
            for j in range(b):
                engine.load(state(j, L), [])
            items = [(ids[j], make_tree(shape, n, vocab, gen)) for j in range(b)]
            results = engine.step(items)
            assert all(r.outcome for r in results), [r.error for r in results]
            stats = engine.last_step
            assert stats.rows == b * (n + 1), "the step computed more than root + tree"
            if rep >= WARMUP:
                samples.append(stats.seconds)
        cells.append({"length": L, "batch": b, "nodes": n, "rows": stats.rows,
                      "context": stats.context, "segments": stats.segments,
                      "median_s": statistics.median(samples), "samples_s": samples})
    return cells


def fit(cells: list[dict]) -> tuple[dict, float]:
    """Fits the verify-cost model on every timed step; (coefficients, mean |relative error| of
    its prediction of the cell medians)."""
    model = VerifyCostModel(decay=1.0, window=100_000, min_samples=4)
    for c in cells:
        for s in c["samples_s"]:
            model.observe(c["rows"], c["context"], c["segments"], s)
    result = model.fit()
    errors = [abs(result.predict(c["rows"], c["context"], c["segments"]) / c["median_s"] - 1)
              for c in cells]
    return asdict(result), statistics.mean(errors)


def markdown(report: dict) -> str:
    cells = {(c["length"], c["batch"], c["nodes"]): c for c in report["cells"]}
    lengths = sorted({k[0] for k in cells})
    batches = sorted({k[1] for k in cells})
    nodes = sorted({k[2] for k in cells})
    cols = [(b, L) for b in batches for L in lengths]
    head = "| n \\ b, L | " + " | ".join(f"b={b} L={L}" for b, L in cols) + " |"
    rule = "|---:|" + "---:|" * len(cols)
    ms = [f"| {n} | " + " | ".join(f"{1e3 * cells[L, b, n]['median_s']:.1f}" for b, L in cols)
          + " |" for n in nodes]
    base = nodes[0]
    rel = [f"| {n} | " + " | ".join(
        f"{cells[L, b, n]['median_s'] / cells[L, b, base]['median_s']:.2f}" for b, L in cols)
        + " |" for n in nodes]
    f = report["fit"]
    return "\n".join([
        f"### {report['model']}, {report['weights']}, {report['runner']} forward: verifier step cost, {report['tree']} trees "
        f"of n nodes per request, median of {report['reps']} steps", "",
        "ms per step (b requests, context L, one tree of n nodes each):", "", head, rule, *ms, "",
        f"Relative cost vs n={base} (SSSD figure 3 style):", "", head, rule, *rel, "",
        f"Fit over {f['samples']} steps: seconds = {1e3 * f['intercept_s']:.2f} ms "
        f"{1e6 * f['per_row_s']:+.1f} us x rows {1e6 * f['per_context_s']:+.3f} us x context "
        f"{1e3 * f['per_segment_s']:+.2f} ms x segments (rows = b(n+1), context = b(L+n), "
        f"segments = b); mean |relative error| on the cells {100 * report['fit_error']:.0f}%.",
        ""])


def run(settings: Settings, args) -> dict:
    from bench.peers_llama import quant
    from specmesh_services.common import models
    from specmesh_services.common.lean import LeanDecoder
    from specmesh_services.verifier.ggml_engine import GgmlLM
    from specmesh_services.verifier.server import served_weights

    lengths, batches, nodes = (sorted(int(x) for x in v.split(",") if x)
                               for v in (args.lengths, args.batches, args.nodes))
    lm, engine = build(settings, max(batches), max(lengths), max(nodes))
    if isinstance(lm, GgmlLM):
        weights, runner = f"GGUF-{quant(lm.model.path)}", "ggml"
    else:
        weights = served_weights(settings, models.resolve(settings.model, settings.cache_dir))
        runner = "lean" if isinstance(lm, LeanDecoder) else "transformers"
    cells = measure(engine, lm.vocab_size, lengths, batches, nodes, args.reps, args.tree)
    coefficients, error = fit(cells)
    return {"model": settings.model, "dtype": str(lm.dtype).removeprefix("torch."),
            "weights": weights, "runner": runner,
            "tree": args.tree, "reps": args.reps, "attention": engine.backend.name,
            "cells": cells, "fit": coefficients, "fit_error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"[{','.join(MODELS)}]")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--target-weights", choices=("auto", "float", "native"), default="auto")
    parser.add_argument("--runners", default="auto",
                        help="target forwards, comma-separated: auto, lean, transformers, ggml "
                        "(llama.cpp on the GGUF file) [auto]")
    parser.add_argument("--tree", choices=("random", "chain"), default="random",
                        help="tree shape: random recursive trees or chains [random]")
    parser.add_argument("--lengths", help=f"context lengths L [{FULL['lengths']}]")
    parser.add_argument("--batches", help=f"requests per step b [{FULL['batches']}]")
    parser.add_argument("--nodes", help=f"tree nodes per request n [{FULL['nodes']}]")
    parser.add_argument("--reps", type=int, help=f"timed steps per cell [{FULL['reps']}]")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    RESULTS.mkdir(parents=True, exist_ok=True)
    compute = compute_executor()  # all torch work on one thread (one OpenMP team)
    for model, runner in ((m, r) for m in args.models.split(",") if m
                          for r in args.runners.split(",") if r):
        settings = Settings(model=model, dtype=args.dtype, target_weights=args.target_weights,
                            target_runner=runner)
        report = compute.submit(run, settings, args).result()
        text = markdown(report)
        print(text, flush=True)
        name = f"verify-cost-{model}-{report['weights']}-{report['runner']}"
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
        (RESULTS / f"{name}.md").write_text(header("verify cost", args.quick) + "\n" + text)
        print(f"written: {RESULTS / name}.json, .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
