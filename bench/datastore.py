"""The lookup datastore (SSSD) as a drafter: build cost, accepted length against HF prompt lookup
with the same node budget, lookup latency, and (--e2e) the 1.5B target end to end
(docs/benchmarks/scripts.md).

    python -m bench.datastore                       # build + quality + latency (~30 min here)
    python -m bench.datastore --e2e                 # + the 1.5B end-to-end run (hours on 2 cores)
    python -m bench.datastore --quick               # smoke run: 6 prompts x 32 tokens
Writes bench/results/datastore.json and .md. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, replace

import numpy as np

from bench.run import (RESULTS, Config, MethodResult, load_prompts, run_embedded,
                       run_hf_methods, save_report)
from specmesh_services.common import models
from specmesh_services.common.config import DatastoreSettings, Settings
from specmesh_services.common.serving import compute_executor
from specmesh_services.datastore import build
from specmesh_services.datastore.engine import LookupEngine, LookupRequest, open_for_target

BATCHES = (1, 8, 32)


def ensure_datastore(model: str) -> dict:
    settings = Settings(model=model)
    tokenizer = build.target_tokenizer(settings)
    path = build.output_dir(settings, "sharegpt", tokenizer)
    if not (path / "meta.json").is_file():
        build.build(settings, tokenizer=tokenizer)
    meta = json.loads((path / "meta.json").read_text())
    return {"path": str(path), "num_tokens": meta["num_tokens"],
            "num_documents": meta["num_documents"], "bytes": meta["bytes"],
            "build_seconds": meta.get("build_seconds"), "discounts": meta.get("discounts")}


def summarize(result: MethodResult, plain: MethodResult | None) -> dict:
    out = {"method": result.method, "tok_s": result.tok_s,
           "mean_accepted_length": result.mean_accepted_length,
           "speedup": result.tok_s / plain.tok_s if plain and plain.tok_s else None,
           "identical_to_plain": (sum(a == b for a, b in zip(result.outputs, plain.outputs))
                                  if plain else None)}
    return out


def by_kind(row: dict, result: MethodResult, plain: MethodResult, kinds: list[str]) -> dict:
    """Adds tok/s, speedup and accepted length per prompt kind (chat / code) to `row`."""
    for kind in ("chat", "code"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if not idx:
            continue
        tokens = sum(len(result.outputs[i]) for i in idx)
        seconds = sum(result.seconds_per_prompt[i] for i in idx)
        plain_tok_s = (sum(len(plain.outputs[i]) for i in idx)
                       / sum(plain.seconds_per_prompt[i] for i in idx))
        row[f"tok_s_{kind}"] = tokens / seconds
        row[f"speedup_{kind}"] = tokens / seconds / plain_tok_s
        row[f"mean_accepted_length_{kind}"] = tokens / sum(result.forwards_per_prompt[i]
                                                           for i in idx)
    return row


def quality(config: Config, nodes: int, compute) -> dict:
    settings = Settings(model=config.model, dtype=config.dtype)
    tokenizer = models.load_tokenizer(models.resolve(config.model, settings.cache_dir))
    prompts = load_prompts(config, tokenizer)
    hf = compute.submit(run_hf_methods, config, prompts, ("plain", "hf-prompt-lookup"),
                        nodes).result()
    mesh = settings.with_overrides(**{"speculation.source": "datastore",
                                      "speculation.max_nodes": nodes, "speculation.depth": nodes})
    ours = run_embedded(config, prompts, compute, mesh, "specmesh-datastore")
    plain = hf[0]
    kinds = ["code" if p.category == "code" else "chat" for p in prompts]
    rows = [by_kind(summarize(result, plain), result, plain, kinds) for result in [*hf, ours]]
    lookup = next(r for r in rows if r["method"] == "hf-prompt-lookup")
    mine = rows[-1]
    return {"prompts": [p.name for p in prompts], "nodes_per_step": nodes, "methods": rows,
            "ratio_vs_prompt_lookup": mine["mean_accepted_length"] /
            lookup["mean_accepted_length"],
            "plain_outputs": plain.outputs, "prompt_ids": [p.ids for p in prompts]}


def latency(model: str, prompt_ids: list[list[int]], outputs: list[list[int]], nodes: int,
            calls: int = 100) -> list[dict]:
    settings = Settings(model=model)
    store = open_for_target(settings, build.target_tokenizer(settings))
    engine = LookupEngine(store, DatastoreSettings())
    evict = np.ones(64 << 20, np.float32)  # 256 MB: more than the last-level cache
    rows = []
    for b in BATCHES:
        for cold in (False, True):
            tag = f"b{b}-{'cold' if cold else 'warm'}"
            seqs = [(prompt_ids[i % len(prompt_ids)], outputs[i % len(outputs)])
                    for i in range(b)]
            engine.lookup([LookupRequest(f"{tag}-{i}", p, nodes, nodes, reset=True)
                           for i, (p, _) in enumerate(seqs)])
            per_seq, per_call = [], []
            for step in range(calls):
                items = [LookupRequest(f"{tag}-{i}", out[2 * step:2 * step + 2] or [out[-1]],
                                       nodes, nodes) for i, (_, out) in enumerate(seqs)]
                if cold:
                    evict.sum()
                start = time.perf_counter()
                engine.lookup(items)
                seconds = time.perf_counter() - start
                per_call.append(seconds)
                per_seq.append(seconds / b)
            engine.release([f"{tag}-{i}" for i in range(b)])
            rows.append({"batch": b, "cold": cold, "calls": calls,
                         "per_sequence_ms_p50": 1e3 * float(np.percentile(per_seq, 50)),
                         "per_sequence_ms_p99": 1e3 * float(np.percentile(per_seq, 99)),
                         "per_call_ms_p50": 1e3 * float(np.percentile(per_call, 50)),
                         "per_call_ms_p99": 1e3 * float(np.percentile(per_call, 99))})
    return rows


def e2e(config: Config, compute, nodes: int, with_draft: bool,
        tree_sizes: tuple[str, ...] = ("fixed",)) -> dict:
    settings = Settings(model=config.model, dtype=config.dtype)
    tokenizer = models.load_tokenizer(models.resolve(config.model, settings.cache_dir))
    prompts = load_prompts(config, tokenizer)
    kinds = ["code" if p.category == "code" else "chat" for p in prompts]
    plain, = compute.submit(run_hf_methods, config, prompts, ("plain",)).result()
    rows = [by_kind(summarize(plain, plain), plain, plain, kinds)]
    runs = [("datastore", "specmesh-datastore")]
    if with_draft:
        runs.append(("both", "specmesh-datastore+draft"))
    for source, name in runs:
        for sizing in tree_sizes:
            mesh = settings.with_overrides(drafters=[config.draft], **{
                "speculation.source": source, "speculation.depth": config.depth,
                "speculation.max_nodes": nodes, "speculation.tree_size": sizing})
            label = name + ("-adaptive" if sizing == "adaptive" else "")
            result = run_embedded(config, prompts, compute, mesh, label)
            row = by_kind(summarize(result, plain), result, plain, kinds)
            steps = result.target_forwards - len(prompts)  # after each prefill step
            row["mean_tree_size"] = result.draft_tokens / steps if steps else 0.0
            row["plain_step_fraction"] = result.plain_steps / steps if steps else 0.0
            rows.append(row)
    return {"model": config.model, "draft": config.draft, "dtype": config.dtype,
            "prompts": len(prompts), "mtbench": config.mtbench, "humaneval": config.humaneval,
            "max_tokens": config.max_tokens, "nodes": nodes, "depth": config.depth,
            "methods": rows}


def markdown(report: dict) -> str:
    lines = []
    for key, what in (("build", "quality target"), ("e2e_build", "end-to-end target")):
        if key in report:
            b = report[key]
            lines.append(f"Datastore ({what}): ShareGPT V3, {b['num_documents']:,} documents, "
                         f"{b['num_tokens']:,} tokens, {b['bytes'] / 2**20:,.0f} MiB on disk, "
                         f"built in {b['build_seconds']:.0f} s (tokenize + suffix array).")
    if "quality" in report:
        q = report["quality"]
        c = report["config"]
        lines += ["", f"Quality: {c['model']} target, {c['dtype']}, {len(q['prompts'])} prompts "
                      f"({c['mtbench']} MT-Bench + {c['humaneval']} HumanEval) x "
                      f"{c['max_tokens']} tokens, {q['nodes_per_step']} draft nodes per step", "",
                  "| method | tok/s | speedup | accepted length | chat | code | identical to plain |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in q["methods"]:
            lines.append(f"| {r['method']} | {r['tok_s']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['mean_accepted_length']:.2f} | {r['mean_accepted_length_chat']:.2f} "
                         f"| {r['mean_accepted_length_code']:.2f} | {r['identical_to_plain']}/"
                         f"{len(q['prompts'])} |")
        lines += ["", f"Accepted length, datastore / HF prompt lookup: "
                      f"{q['ratio_vs_prompt_lookup']:.2f}x (goal >= 1.3x)."]
    if "latency" in report:
        lines += ["", "Lookup latency (full datastore, engine only, 100 calls per batch size; "
                      "cold: caches evicted before each call):",
                  "", "| batch | caches | per sequence p50 ms | p99 ms | per call p50 ms | p99 ms |",
                  "|---:|---|---:|---:|---:|---:|"]
        for r in report["latency"]:
            caches = "cold" if r.get("cold") else "warm"
            lines.append(f"| {r['batch']} | {caches} | {r['per_sequence_ms_p50']:.3f} | "
                         f"{r['per_sequence_ms_p99']:.3f} | {r['per_call_ms_p50']:.2f} | "
                         f"{r['per_call_ms_p99']:.2f} |")
    if "e2e" in report:
        e = report["e2e"]
        lines += ["", f"End to end: {e['model']} target, {e['dtype']}, batch 1, {e['prompts']} "
                      f"prompts ({e['mtbench']} MT-Bench + {e['humaneval']} HumanEval) x "
                      f"{e['max_tokens']} tokens, {e['nodes']} nodes / depth {e['depth']} per "
                      f"step (draft {e['draft']} where merged)", "",
                  "| method | tok/s | speedup | chat | code | accepted length | chat | code "
                  "| mean tree | plain steps | identical to plain |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in e["methods"]:
            lines.append(f"| {r['method']} | {r['tok_s']:.2f} | {r['speedup']:.2f}x | "
                         f"{r.get('speedup_chat', 0):.2f}x | {r.get('speedup_code', 0):.2f}x | "
                         f"{r['mean_accepted_length']:.2f} | "
                         f"{r.get('mean_accepted_length_chat', 0):.2f} | "
                         f"{r.get('mean_accepted_length_code', 0):.2f} | "
                         f"{r.get('mean_tree_size', 0):.1f} | "
                         f"{100 * r.get('plain_step_fraction', 0):.0f}% | "
                         f"{r['identical_to_plain']}/{e['prompts']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="quality target [smollm2-135m]")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto = bf16 where the hardware runs it natively, else fp32 [auto]")
    parser.add_argument("--mtbench", type=int, default=80, help="MT-Bench questions [80]")
    parser.add_argument("--humaneval", type=int, default=20, help="HumanEval problems [20]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=10, help="draft nodes per step [10]")
    parser.add_argument("--e2e", action="store_true", help="also the Qwen2.5-Coder-1.5B run")
    parser.add_argument("--e2e-model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--e2e-draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--e2e-only", action="store_true",
                        help="run only the end-to-end part, adding it to the existing report")
    parser.add_argument("--e2e-dtype", choices=["auto", "bfloat16", "float32"],
                        help="end-to-end dtype [--dtype]")
    parser.add_argument("--e2e-nodes", type=int, help="end-to-end draft nodes per step [--nodes]")
    parser.add_argument("--e2e-depth", type=int, default=4, help="end-to-end tree depth [4]")
    parser.add_argument("--e2e-mtbench", type=int, help="end-to-end MT-Bench questions "
                        "[--mtbench]; a subset keeps the one-per-category order")
    parser.add_argument("--e2e-humaneval", type=int, help="end-to-end HumanEval [--humaneval]")
    parser.add_argument("--e2e-with-draft", action="store_true",
                        help="end to end, also datastore + the draft model merged")
    parser.add_argument("--e2e-tree-size", nargs="+", choices=["fixed", "adaptive"],
                        default=["fixed"], help="end-to-end tree sizing(s) to run [fixed]")
    parser.add_argument("--quick", action="store_true", help="6 prompts x 32 tokens")
    parser.add_argument("--latency-only", action="store_true",
                        help="only the lookup latency, each prompt continued by the next "
                             "prompt's tokens (no target run)")
    args = parser.parse_args(argv)
    dtype = str(models.resolve_dtype(args.dtype)).removeprefix("torch.")
    config = Config(args.model, "layers:1", dtype, mtbench=args.mtbench,
                    humaneval=args.humaneval, max_tokens=args.max_tokens)
    if args.quick:
        config = replace(config, mtbench=4, humaneval=2, max_tokens=32)
    compute = compute_executor()
    name = "datastore" + ("-quick" if args.quick else "")
    if args.latency_only:
        prompt_ids = [p.ids for p in load_prompts(config, models.load_tokenizer(
            models.resolve(config.model, Settings().cache_dir)))]
        report = {"machine": platform.processor() or platform.machine(),
                  "date": time.strftime("%Y-%m-%d"), "config": asdict(config),
                  "latency": latency(args.model, prompt_ids, prompt_ids[1:] + prompt_ids[:1],
                                     args.nodes)}
        save_report(f"{name}-latency", report, markdown(report))
        compute.shutdown()
        return 0
    if args.e2e_only:  # added to the earlier report where there is one
        path = RESULTS / f"{name}.json"
        report = (json.loads(path.read_text()) if path.is_file() else
                  {"machine": platform.processor() or platform.machine(),
                   "date": time.strftime("%Y-%m-%d"), "config": asdict(config)})
    else:
        report = {"machine": platform.processor() or platform.machine(),
                  "date": time.strftime("%Y-%m-%d"), "config": asdict(config),
                  "build": ensure_datastore(args.model)}
        q = quality(config, args.nodes, compute)
        report["latency"] = latency(args.model, q.pop("prompt_ids"), q.pop("plain_outputs"),
                                    args.nodes)
        report["quality"] = q
    if args.e2e or args.e2e_only:
        report["e2e_build"] = ensure_datastore(args.e2e_model)
        e2e_config = replace(
            config, model=args.e2e_model, draft=args.e2e_draft, depth=args.e2e_depth,
            dtype=str(models.resolve_dtype(args.e2e_dtype)).removeprefix("torch.")
            if args.e2e_dtype else config.dtype,
            mtbench=config.mtbench if args.e2e_mtbench is None else args.e2e_mtbench,
            humaneval=config.humaneval if args.e2e_humaneval is None else args.e2e_humaneval)
        report["e2e"] = e2e(e2e_config, compute, args.e2e_nodes or args.nodes,
                            args.e2e_with_draft, tuple(args.e2e_tree_size))
    save_report(name, report, markdown(report))
    compute.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
