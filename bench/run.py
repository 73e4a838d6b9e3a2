"""Every decoding method on the same prompts in one process, batch 1, greedy: plain
transformers, its assisted and prompt-lookup generation, specmesh embedded and as a multi-process
stack; tok/s, speedup, accepted length, identical outputs (docs/benchmarks/scripts.md).

    python -m bench.run                      # the `methods` suite (4 configurations, ~1.5 h)
    python -m bench.run --model smollm2-135m --draft layers:24 --dtype bfloat16 --mtbench 4
Writes bench/results/<name>.json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import time
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specmesh_services.common.prompts import humaneval_problems, mtbench_questions
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.serving import compute_executor

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("plain", "hf-assisted", "hf-prompt-lookup", "specmesh-embedded", "specmesh-stack")


@dataclass(frozen=True)
class Config:
    model: str
    draft: str
    dtype: str
    depth: int = 3
    width: int = 1
    mtbench: int = 8  # questions, one per category first (every 10th)
    humaneval: int = 2
    max_tokens: int = 128
    target_weights: str = "float"  # the mesh's target (Settings.target_weights); plain stays float

    @property
    def name(self) -> str:
        return f"{self.model}_{self.draft.replace(':', '')}_{self.dtype}_d{self.depth}w{self.width}"


SUITES = {
    # both default targets with their drafts, float32 and bfloat16, fixed chains
    "methods": [
        Config("smollm2-135m", "layers:24", "float32"),
        Config("smollm2-135m", "layers:24", "bfloat16"),
        Config("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "float32", depth=4),
        Config("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "bfloat16", depth=4),
    ],
}


@dataclass
class Prompt:
    name: str  # "mtbench-81" / "HumanEval/0"
    category: str
    request: dict  # keyword arguments of specmesh.build_request (prompt= or messages=)
    ids: list[int]  # what the gateway tokenizes it to


@dataclass
class MethodResult:
    method: str
    tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    forwards_per_prompt: list[int] = field(default_factory=list)
    seconds_per_prompt: list[float] = field(default_factory=list)
    draft_tokens: int = 0  # tree nodes verified (specmesh methods)
    plain_steps: int = 0  # steps that verified no tree (adaptive sizing switched it off)
    identical_to_plain: int | None = 0
    decisions: list = field(default_factory=list)  # every step's StepDecision (specmesh methods)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0


def save_report(name: str, report, text: str) -> None:
    """bench/results/<name>.json (the figures) and .md (the table), then the table printed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


# ---------------------------------------------------------------------------------------------
# prompts


def mtbench_prompts(tokenizer, count: int) -> list[Prompt]:
    """The first `count` MT-Bench first turns through the chat template, one per category
    first."""
    questions = mtbench_questions()
    picked = (questions[::10] + [q for i, q in enumerate(questions) if i % 10])[:count]
    out = []
    for q in picked:
        messages = [{"role": "user", "content": q["turns"][0]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(Prompt(f"mtbench-{q['question_id']}", q["category"], {"messages": messages},
                          tokenizer(text, add_special_tokens=False).input_ids))
    return out


def load_prompts(config: Config, tokenizer) -> list[Prompt]:
    out = mtbench_prompts(tokenizer, config.mtbench)
    for p in humaneval_problems()[:config.humaneval]:
        out.append(Prompt(p["task_id"], "code", {"prompt": p["prompt"]},
                          tokenizer(p["prompt"]).input_ids))
    return out


# ---------------------------------------------------------------------------------------------
# transformers methods


def run_hf_methods(config: Config, prompts: list[Prompt],
                   methods: tuple[str, ...] = ("plain", "hf-assisted", "hf-prompt-lookup"),
                   lookup_tokens: int = 10) -> list[MethodResult]:
    """The transformers methods, in order; hf-prompt-lookup drafts `lookup_tokens` per step."""
    dtype = models.resolve_dtype(config.dtype)
    settings = Settings(model=config.model, dtype=config.dtype)
    path = models.resolve(config.model, settings.cache_dir)
    target = models.load_model(path, dtype)
    draft = _load_draft(config, settings, path) if "hf-assisted" in methods else None
    forwards = [0]
    hook = target.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    pad = models.load_tokenizer(path).eos_token_id
    variants = {"plain": {}, "hf-assisted": {"assistant_model": draft},
                "hf-prompt-lookup": {"prompt_lookup_num_tokens": lookup_tokens}}
    variants = {m: variants[m] for m in methods}
    results = []
    try:
        for method, extra in variants.items():
            result = MethodResult(method)
            _hf_generate(target, prompts[0].ids[:16], 4, pad, extra)  # warm-up
            for prompt in tqdm(prompts, desc=f"{config.name} {method}", leave=False):
                forwards[0] = 0
                start = time.perf_counter()
                new = _hf_generate(target, prompt.ids, config.max_tokens, pad, extra)
                elapsed = time.perf_counter() - start
                result.seconds += elapsed
                result.seconds_per_prompt.append(elapsed)
                result.tokens += len(new)
                result.target_forwards += forwards[0]
                result.forwards_per_prompt.append(forwards[0])
                result.outputs.append(new)
            results.append(result)
    finally:
        hook.remove()
        del target, draft
        gc.collect()
    return results


def _load_draft(config: Config, settings: Settings, target_path):
    """The assistant model of a draft spec, quantized weights included (`@int8`, `@int4`,
    `@auto`: the same draft the mesh runs, so the comparison is of the methods, not of the
    drafts)."""
    from specmesh_services.drafter.models import DraftSpec, load_draft

    return load_draft(DraftSpec.parse(config.draft), settings, target_path)


@torch.inference_mode()
def _hf_generate(model, ids: list[int], max_new: int, pad: int, extra: dict) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=max_new, pad_token_id=pad, **extra)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------------------------
# specmesh methods


def mesh_settings(config: Config) -> Settings:
    return Settings(model=config.model, dtype=config.dtype, drafters=[config.draft]).with_overrides(
        **{"speculation.depth": config.depth, "speculation.width": config.width,
           "speculation.tree_size": "fixed"})  # the configured tree every step, never sized


def run_embedded(config: Config, prompts: list[Prompt], compute: Executor,
                 settings: Settings | None = None, method: str = "specmesh-embedded"
                 ) -> MethodResult:
    from specmesh_services.launch.embedded import EmbeddedMesh

    async def main() -> MethodResult:
        async with EmbeddedMesh.start(settings or mesh_settings(config), compute) as mesh:
            await mesh.generate(prompt="warm up", max_tokens=4)
            result = MethodResult(method)
            for prompt in tqdm(prompts, desc=f"{config.name} {method}", leave=False):
                start = time.perf_counter()
                out = await mesh.generate(max_tokens=config.max_tokens, **prompt.request)
                _record(result, prompt, out, time.perf_counter() - start)
            return result

    result = asyncio.run(main())
    gc.collect()
    return result


def run_stack(config: Config, prompts: list[Prompt], log_dir: Path) -> MethodResult:
    from specmesh_services.launch.procs import free_port
    from specmesh_services.launch.redis_server import RedisServer
    from specmesh_services.launch.stack import Stack
    from specmesh import Client

    result = MethodResult("specmesh-stack")
    with RedisServer() as redis:
        stack = Stack(mesh_settings(config).with_overrides(redis_url=redis.url), free_port(),
                      log_dir)
        try:
            stack.start()
            with Client(f"127.0.0.1:{stack.gateway_port}", timeout=3600) as client:
                client.generate("warm up", max_tokens=4)
                for prompt in tqdm(prompts, desc=f"{config.name} stack", leave=False):
                    start = time.perf_counter()
                    out = (client.chat(prompt.request["messages"], max_tokens=config.max_tokens)
                           if "messages" in prompt.request
                           else client.generate(prompt.request["prompt"],
                                                max_tokens=config.max_tokens))
                    _record(result, prompt, out, time.perf_counter() - start)
        finally:
            stack.stop()
    return result


def _record(result: MethodResult, prompt: Prompt, out, seconds: float) -> None:
    if out.stats.prompt_tokens != len(prompt.ids):
        raise RuntimeError(f"{prompt.name}: the gateway tokenized {out.stats.prompt_tokens} "
                           f"tokens, the benchmark {len(prompt.ids)}")
    result.seconds += seconds
    result.seconds_per_prompt.append(seconds)
    result.tokens += len(out.token_ids)
    result.target_forwards += out.stats.steps
    result.forwards_per_prompt.append(out.stats.steps)
    result.draft_tokens += out.stats.draft_tokens
    result.plain_steps += out.stats.plain_steps
    result.decisions.extend(out.stats.decisions)
    result.outputs.append(list(out.token_ids))


# ---------------------------------------------------------------------------------------------
# one configuration, report


def run_config(config: Config, methods: list[str], log_dir: Path, compute: Executor) -> dict:
    """Runs the methods of one configuration; all torch work of this process runs on `compute`
    (one thread, one OpenMP team: see EmbeddedMesh.start)."""
    settings = Settings(model=config.model)
    tokenizer = models.load_tokenizer(models.resolve(config.model, settings.cache_dir))
    prompts = load_prompts(config, tokenizer)
    results: list[MethodResult] = []
    hf = [m for m in methods if m.startswith(("plain", "hf-"))]
    if hf:
        hf_results = compute.submit(run_hf_methods, config, prompts).result()
        results += [r for r in hf_results if r.method in hf]
    if "specmesh-embedded" in methods:
        results.append(run_embedded(config, prompts, compute))
    if "specmesh-stack" in methods:
        results.append(run_stack(config, prompts, log_dir))
    plain = next((r for r in results if r.method == "plain"), None)
    for r in results:
        if plain is not None:
            r.identical_to_plain = sum(a == b for a, b in zip(r.outputs, plain.outputs))
        else:
            r.identical_to_plain = None
    return {"config": asdict(config), "prompts": [p.name for p in prompts],
            "categories": [p.category for p in prompts], "methods": [
                {**asdict(r), "tok_s": r.tok_s, "mean_accepted_length": r.mean_accepted_length,
                 "speedup": r.tok_s / plain.tok_s if plain and plain.tok_s else None}
                for r in results]}


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"### {c['model']} target, draft `{c['draft']}`, {c['dtype']}, depth {c['depth']} "
             f"width {c['width']}, {len(report['prompts'])} prompts x {c['max_tokens']} tokens",
             "", "| method | tok/s | speedup vs plain | mean accepted length | identical to plain |",
             "|---|---:|---:|---:|---:|"]
    n = len(report["prompts"])
    by_method = {m["method"]: m for m in report["methods"]}
    for m in report["methods"]:
        speedup = f"{m['speedup']:.2f}x" if m["speedup"] is not None else "-"
        mal = f"{m['mean_accepted_length']:.2f}"
        same = "-" if m["identical_to_plain"] is None else f"{m['identical_to_plain']}/{n}"
        lines.append(f"| {m['method']} | {m['tok_s']:.2f} | {speedup} | {mal} | {same} |")
    if "specmesh-embedded" in by_method and "specmesh-stack" in by_method:
        ratio = by_method["specmesh-stack"]["tok_s"] / by_method["specmesh-embedded"]["tok_s"]
        lines += ["", f"Multi-process overhead: stack tok/s = {ratio:.2f} x embedded tok/s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), help="predefined configurations "
                        "[methods when no --model is given]")
    parser.add_argument("--model", help="target model")
    parser.add_argument("--draft", default="layers:24", help="draft spec [layers:24]")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], help="[bfloat16]")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--mtbench", type=int, default=8, help="MT-Bench questions [8]")
    parser.add_argument("--humaneval", type=int, default=2, help="HumanEval problems [2]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    parser.add_argument("--name", help="output file name [the suite or configuration name]")
    args = parser.parse_args(argv)
    suite = args.suite or (None if args.model else "methods")
    if suite is None:
        configs = [Config(args.model, args.draft, d, args.depth, args.width, args.mtbench,
                          args.humaneval, args.max_tokens) for d in args.dtype]
    else:
        configs = SUITES[suite]
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    name = args.name or suite or (configs[0].name if len(configs) == 1 else "custom")
    RESULTS.mkdir(parents=True, exist_ok=True)
    reports, texts = [], []
    header = (f"specmesh benchmark `{name}` — {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
              f"torch {torch.__version__}\n")
    compute = compute_executor()
    for config in configs:
        report = run_config(config, methods, RESULTS / f"{name}-logs" / config.name, compute)
        reports.append(report)
        texts.append(markdown(report))
        print(texts[-1], flush=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(reports, indent=1))
        (RESULTS / f"{name}.md").write_text(header + "\n" + "\n".join(texts))
    print(f"written: {RESULTS / name}.json, .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
