"""The router's mechanisms, one added at a time (Minions figure 10 / SPIN figure 11 style), plus
LBSS against SPIN's two selection baselines, at batch 1 and c concurrent, each method's speedup
against the plain runs bracketing it (the methods: docs/benchmarks/scripts.md).

    python -m bench.router                                   # SmolLM2-135M, auto dtype
    python -m bench.router --model qwen2.5-coder-1.5b --dtype bfloat16 \\
        --drafts qwen2.5-coder-0.5b@auto layers:8
    python -m bench.router --quick                           # smoke run: 4 prompts x 32 tokens
Writes bench/results/router-<model>-<dtype>[-<tag>].json and .md. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import asdict, replace

from tqdm.auto import tqdm

from bench.batch import run_plain
from bench.run import (RESULTS, Config, MethodResult, Prompt, _record, load_prompts,
                       run_hf_methods, save_report)
from specmesh_services.common import models
from specmesh_services.common.config import PLAIN_DECODING, Settings
from specmesh_services.common.serving import compute_executor
from specmesh_services.verifier.server import served_weights

DRAFTS = {"smollm2-135m": ("layers:8", "layers:20"),
          "qwen2.5-coder-1.5b": ("qwen2.5-coder-0.5b@auto", "layers:8")}
NO_PIPELINE = {"router.draft_batch_max": 1, "router.max_pending_trees": 0}


def drafts_of(model: str) -> tuple[str, str]:
    """The two draft models of a target (DRAFTS; else two layer-truncated copies)."""
    return DRAFTS.get(model, ("layers:8", "layers:16"))


def ablation(drafts: tuple[str, str], nodes: int, model: str) -> list[tuple[str, dict, dict]]:
    """(name, top-level overrides, dotted overrides) of each method, cumulative."""
    fixed = {"speculation.tree_size": "fixed"}  # the default is adaptive
    one = ({"drafters": [drafts[0]]}, {"speculation.source": "model", **fixed, **NO_PIPELINE})
    many = {"drafters": list(drafts)}
    vote = {"speculation.source": "both", "speculation.voting": True, **fixed,
            "speculation.max_nodes": nodes, **NO_PIPELINE}
    bandit = {**vote, "speculation.selection": "lbss"}
    adaptive = {**bandit, "speculation.tree_size": "adaptive"}
    full = {k: v for k, v in adaptive.items() if k not in NO_PIPELINE}
    # what `up` serves: the model's default source (a given draft would make auto the model)
    default = ({"drafters": [drafts[0]]},
               {"speculation.source": models.serving_source(model, "auto")})
    return [("mesh-plain", {}, PLAIN_DECODING), ("fixed", *one), ("default", *default),
            ("+voting", many, vote),
            ("+bandit", many, bandit),
            ("+adaptive", many, adaptive), ("+pipeline", many, full),
            ("greedy", many, {**full, "speculation.selection": "greedy"}),
            ("epsilon-greedy", many, {**full, "speculation.selection": "epsilon-greedy"}),
            ("minions-length", many, {**full, "speculation.tree_size": "length"})]


def served_config(model: str, dtype: str, target_weights: str, draft: str, compute: Executor,
                  **fields) -> Config:
    """A run's Config: the dtype resolved, and the target's weights as `specmesh up` serves them
    with this dtype (probed on the compute thread: the int4 probe is a torch op, and a second
    thread's OpenMP team halves the speed of every later one, services/launch/embedded.py)."""
    weights = compute.submit(served_weights, Settings(model=model, dtype=dtype,
                                                      target_weights=target_weights),
                             models.resolve(model, Settings().cache_dir)).result()
    resolved = str(models.resolve_dtype(dtype)).removeprefix("torch.")
    return Config(model, draft, resolved, target_weights=weights, **fields)


def base_settings(config: Config, min_probability: float = 0.6, draft_vocab: int = 0
                  ) -> Settings:
    """The mesh settings every method starts from: the run's target, dtype, weights and tree."""
    return Settings(model=config.model, dtype=config.dtype, draft_vocab=draft_vocab,
                    target_weights=config.target_weights).with_overrides(**{
        "speculation.depth": config.depth, "speculation.width": config.width,
        "speculation.min_probability": min_probability})


def run_mesh(config: Config, prompts: list[Prompt], settings: Settings, c: int,
             compute: Executor, name: str,
             on_start: Callable[[object], None] | None = None) -> MethodResult:
    """The prompts through an embedded mesh with at most c in flight (batch 1: one at a time,
    each timed on its own). `on_start(mesh)` is called after the warm-up, just before the timed
    prompts (instruments of bench.step_time)."""
    from specmesh_services.launch.embedded import EmbeddedMesh

    async def main() -> MethodResult:
        async with EmbeddedMesh.start(settings.with_overrides(**{"verifier.batch_size": c}),
                                      compute) as mesh:
            await mesh.generate(prompt="warm up", max_tokens=4)
            if on_start is not None:
                on_start(mesh)
            result = MethodResult(name)
            limit = asyncio.Semaphore(c)
            timed: list[tuple[object, float]] = [None] * len(prompts)

            async def one(i: int, bar) -> None:
                async with limit:
                    start = time.perf_counter()
                    out = await mesh.generate(max_tokens=config.max_tokens, **prompts[i].request)
                    timed[i] = (out, time.perf_counter() - start)
                    bar.update()

            with tqdm(total=len(prompts), desc=f"{config.name} {name} c={c}", leave=False) as bar:
                start = time.perf_counter()
                await asyncio.gather(*(one(i, bar) for i in range(len(prompts))))
                total = time.perf_counter() - start
            for prompt, (out, seconds) in zip(prompts, timed):
                _record(result, prompt, out, seconds)
            if c > 1:  # concurrent: throughput over the whole run
                result.seconds = total
            return result

    result = asyncio.run(main())
    gc.collect()
    return result


def row(result: MethodResult, plain: MethodResult, prompts: list[Prompt], c: int) -> dict:
    out = {"method": result.method, "tok_s": result.tok_s,
           "speedup": result.tok_s / plain.tok_s if plain.tok_s else None,
           "mean_accepted_length": result.mean_accepted_length,
           "identical_to_plain": sum(a == b for a, b in zip(result.outputs, plain.outputs)),
           "plain_steps": result.plain_steps, "draft_tokens": result.draft_tokens}
    classes: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        classes[p.category].append(i)
    out["classes"] = {}
    for cls, idx in classes.items():
        tokens = sum(len(result.outputs[i]) for i in idx)
        forwards = sum(result.forwards_per_prompt[i] for i in idx) if result.forwards_per_prompt \
            else 0
        entry = {"accepted_length": tokens / forwards if forwards else 1.0}
        if c == 1 and result.seconds_per_prompt and plain.seconds_per_prompt:
            mine = tokens / sum(result.seconds_per_prompt[i] for i in idx)
            base = (sum(len(plain.outputs[i]) for i in idx)
                    / sum(plain.seconds_per_prompt[i] for i in idx))
            entry["speedup"] = mine / base
        out["classes"][cls] = entry
    return out


def bracket(before: MethodResult, after: MethodResult) -> MethodResult:
    """The plain baseline of a method measured between two plain runs: their mean time (per
    prompt too); outputs of the first (plain decoding is deterministic)."""
    out = replace(before, seconds=(before.seconds + after.seconds) / 2)
    if before.seconds_per_prompt and after.seconds_per_prompt:
        out.seconds_per_prompt = [(a + b) / 2 for a, b in zip(before.seconds_per_prompt,
                                                             after.seconds_per_prompt)]
    return out


def run(config: Config, drafts: tuple[str, str], levels: list[int], nodes: int,
        compute: Executor, methods: list[str] | None,
        hf_methods: tuple[str, ...] = ("plain", "hf-assisted", "hf-prompt-lookup"),
        save=lambda report: None, min_probability: float = 0.6, draft_vocab: int = 0,
        bracketed: bool = True) -> dict:
    """`save(report)` is called after every method: a long run interrupted keeps what it did.

    `bracketed`: plain decoding is timed again after every specmesh method and each method's
    speedup is against the mean of the plain runs just before and after it: a shared machine's
    speed drifts within a run, and a baseline timed once at its start mismeasures the methods
    at its end (docs/decisions/benchmark-method.md)."""
    settings = base_settings(config, min_probability, draft_vocab)
    tokenizer = models.load_tokenizer(models.resolve(config.model, settings.cache_dir))
    prompts = load_prompts(config, tokenizer)
    report = {"config": asdict(config), "drafts": list(drafts), "nodes": nodes,
              "min_probability": min_probability, "draft_vocab": draft_vocab,
              "prompts": [p.name for p in prompts], "levels": {}}
    hf = compute.submit(run_hf_methods, replace(config, draft=drafts[0]), prompts,
                        ("plain", *[m for m in hf_methods if m != "plain"]), 10).result()
    batched = compute.submit(run_plain, config, prompts, [c for c in levels if c > 1]).result()

    def plain_again(c: int) -> MethodResult:
        if c == 1:
            return compute.submit(run_hf_methods, config, prompts, ("plain",)).result()[0]
        return compute.submit(run_plain, config, prompts, [c]).result()[c]

    report["bracketed"] = bracketed
    report["plain_runs"] = {}
    for c in levels:
        plain = hf[0] if c == 1 else batched[c]
        rows = [row(plain, plain, prompts, c)]
        if c == 1:
            rows += [row(r, plain, prompts, c) for r in hf[1:]]
        report["levels"][str(c)] = rows
        runs = report["plain_runs"][str(c)] = [plain.tok_s]
        save(report)
        before = plain
        for name, top, dotted in ablation(drafts, nodes, config.model):
            if methods and name not in methods:
                continue
            mesh = settings.with_overrides(**top, **dotted)
            result = run_mesh(config, prompts, mesh, c, compute, name)
            after = plain_again(c) if bracketed else before
            if bracketed:
                runs.append(after.tok_s)
            base = bracket(before, after)
            rows.append({**row(result, base, prompts, c), "plain_tok_s": base.tok_s})
            save(report)
            before = after
    return report


def markdown(report: dict) -> str:
    c = report["config"]
    weights = ", native int4 weights" if c.get("target_weights") == "native" else ""
    lines = [f"### {c['model']} target, {c['dtype']}{weights}, drafts {', '.join(report['drafts'])} + "
             f"the datastore, depth {c['depth']} (stop below p "
             f"{report.get('min_probability', 0)}), {report['nodes']} nodes, "
             f"{len(report['prompts'])} prompts x {c['max_tokens']} tokens"
             + (f", draft vocabulary {report['draft_vocab']}" if report.get("draft_vocab") else "")]
    for level, rows in report["levels"].items():
        classes = sorted({k for r in rows for k in r["classes"]})
        lines += ["", f"Batch {level}:", "",
                  "| method | tok/s | speedup | accepted length | " + " | ".join(classes)
                  + " | plain steps | identical |",
                  "|---|---:|---:|---:|" + "---:|" * len(classes) + "---:|---:|"]
        for r in rows:
            cells = []
            for k in classes:
                e = r["classes"].get(k, {})
                cell = f"{e.get('accepted_length', 0):.2f}"
                if "speedup" in e:
                    cell += f" ({e['speedup']:.2f}x)"
                cells.append(cell)
            lines.append(f"| {r['method']} | {r['tok_s']:.2f} | {r['speedup']:.2f}x | "
                         f"{r['mean_accepted_length']:.2f} | " + " | ".join(cells) +
                         f" | {r['plain_steps']} | {r['identical_to_plain']}/"
                         f"{len(report['prompts'])} |")
    lines += ["", "Class cells: accepted length (speedup vs plain at batch 1)."]
    if report.get("bracketed"):
        spans = ", ".join(f"batch {c}: {min(r):.2f}-{max(r):.2f} tok/s in {len(r)} runs"
                          for c, r in report.get("plain_runs", {}).items())
        lines.append("Speedups of the specmesh methods are against the mean of the plain runs "
                     f"just before and after each (plain varied over the run: {spans}); the "
                     "transformers methods against the first plain run, timed just before "
                     "them.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--drafts", nargs=2, metavar="SPEC", help="the two draft models "
                        "[per model: smollm2 layers:8 layers:20; qwen 1.5b: the 0.5b@auto, "
                        "layers:8]")
    parser.add_argument("--mtbench", type=int, default=16, help="MT-Bench questions [16]")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval problems [8]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8, help="most draft levels [8]; draft "
                        "models stop earlier where unsure (--min-probability)")
    parser.add_argument("--min-probability", type=float, default=0.6,
                        help="draft models' confidence stop (speculation.min_probability) [0.6]")
    parser.add_argument("--nodes", type=int, default=12, help="node budget per step [12]")
    parser.add_argument("--draft-vocab", type=int, default=0, help="the mesh's draft models "
                        "propose only the N most frequent tokens (FR-Spec, draft_vocab) [0: all]")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                        help="requests in flight [1 8]")
    parser.add_argument("--methods", nargs="+", help="only these specmesh methods")
    parser.add_argument("--hf-methods", nargs="+",
                        choices=["hf-assisted", "hf-prompt-lookup", "none"],
                        default=["hf-assisted", "hf-prompt-lookup"],
                        help="transformers methods at batch 1 besides plain [both]; none = plain "
                             "only")
    parser.add_argument("--no-bracket", dest="bracket", action="store_false",
                        help="time plain decoding once per batch size instead of again after "
                             "every specmesh method (each method's speedup is against the mean "
                             "of the plain runs just before and after it: this machine's speed "
                             "drifts over a long run)")
    parser.add_argument("--target-weights", default="auto", choices=["auto", "float", "native"],
                        help="the mesh's target weights; auto = what `specmesh up` serves with "
                             "this --dtype (native for SmolLM2 with --dtype auto). The plain "
                             "baselines are transformers on the converted float weights")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens")
    parser.add_argument("--tag", default="", help="suffix of the result files (runs in slices "
                        "of --methods / --concurrency do not overwrite each other)")
    args = parser.parse_args(argv)
    drafts = tuple(args.drafts) if args.drafts else drafts_of(args.model)
    compute = compute_executor()
    config = served_config(args.model, args.dtype, args.target_weights, drafts[0], compute,
                           depth=args.depth, width=1, mtbench=args.mtbench,
                           humaneval=args.humaneval, max_tokens=args.max_tokens)
    if args.quick:
        config = replace(config, mtbench=3, humaneval=1, max_tokens=32)
    name = (f"router-{args.model}-{config.dtype}"
            + ("-native" if config.target_weights == "native" else "")
            + ("-quick" if args.quick else "")
            + (f"-{args.tag}" if args.tag else ""))
    head = {"machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d")}

    def save(report: dict, final: bool = False) -> None:
        full = {**head, **report}
        if final:
            save_report(name, full, markdown(full))
        else:  # quietly, after every method
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{name}.json").write_text(json.dumps(full, indent=2))
            (RESULTS / f"{name}.md").write_text(markdown(full))
    save(run(config, drafts, args.concurrency, args.nodes, compute, args.methods,
             tuple(m for m in args.hf_methods if m != "none"), save, args.min_probability,
             args.draft_vocab, args.bracket),
         final=True)
    compute.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
