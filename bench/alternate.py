"""Mesh configurations compared prompt by prompt, alternating, at batch 1.

A shared 2-core machine's speed drifts by up to half within a run, so two configurations timed
one after the other differ by more than most changes make (docs/decisions/benchmark-method.md).
Here every configuration is loaded once, side by side in one process, and each prompt runs
through all of them in turn (the order reversed every other prompt): each prompt's figures come
from the same minute.

    python -m bench.alternate --model qwen2.5-coder-1.5b --dtype bfloat16 --draft-vocab 32768 \\
        --drafts qwen2.5-coder-0.5b@auto --set speculation.depth=8 speculation.tree_size=fixed \\
        --mtbench 8 --humaneval 4 --max-tokens 64 \\
        chain tree2:speculation.width=2 tree3:speculation.width=3

Each CONFIG is NAME[:KEY=VALUE[,KEY=VALUE...]] over the common settings (`--set`); keys are
Settings fields, dotted for sections (`speculation.width`, `router.max_pending_trees`); values
are JSON where they parse (numbers, true/false, ["lists"]), strings otherwise. Reported per
configuration: tok/s, its ratio to the first configuration, accepted length (tokens per target
pass, bonus counted), plain steps, outputs identical to the first configuration's; per prompt:
tok/s of each. Memory: every configuration holds its own target (the 1.5B Qwen in bf16 with a
0.5B draft: ~6 GB each), so three fit in 24 GB and four do not. Writes
bench/results/alternate-<tag>.json and .md. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import re
import time
from dataclasses import asdict

from bench.run import Config, MethodResult, _record, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings, check_keys
from specmesh_services.common.serving import compute_executor


def parse_value(text: str):
    """JSON where it parses (8, 0.5, true, ["a"]), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE items -> {key: value}; a clear error for an item without '='."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def parse_config(text: str) -> tuple[str, dict]:
    """NAME[:KEY=VALUE,...] -> (name, overrides)."""
    name, _, rest = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"a configuration needs a name: {text!r}")
    # split at the commas that start the next KEY=, not those inside a JSON list value
    return name, parse_overrides([p for p in re.split(r",(?=[\w.]+=)", rest) if p])


def summary(results: dict[str, MethodResult]) -> list[dict]:
    """Per configuration: tok/s, ratio to the first, accepted length, identical outputs."""
    first = next(iter(results.values()))
    return [{"config": name, "tok_s": r.tok_s,
             "vs_first": r.tok_s / first.tok_s if first.tok_s else None,
             "mean_accepted_length": r.mean_accepted_length, "plain_steps": r.plain_steps,
             "identical_to_first": sum(a == b for a, b in zip(r.outputs, first.outputs))}
            for name, r in results.items()]


def markdown(report: dict) -> str:
    names = [row["config"] for row in report["summary"]]
    lines = [f"### {report['model']}, {report['dtype']}, batch 1, alternating prompt by prompt",
             "", "Common settings: " + (", ".join(f"`{k}={json.dumps(v)}`"
                                               for k, v in report["common"].items()) or "none"),
             "", "| config | overrides | tok/s | vs first | accepted length | plain steps | "
                 "identical |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in report["summary"]:
        over = ", ".join(f"{k}={json.dumps(v)}" for k, v in report["configs"][row["config"]].items())
        lines.append(f"| {row['config']} | {over or '-'} | {row['tok_s']:.2f} | "
                     f"{row['vs_first']:.3f} | {row['mean_accepted_length']:.2f} | "
                     f"{row['plain_steps']} | {row['identical_to_first']}/"
                     f"{len(report['prompts'])} |")
    lines += ["", "| prompt | class | " + " | ".join(names) + " |",
              "|---|---|" + "---:|" * len(names)]
    for p in report["prompts"]:
        lines.append(f"| {p['name']} | {p['category']} | "
                     + " | ".join(f"{p['tok_s'][n]:.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


async def run(settings: Settings, configs: list[tuple[str, dict]], config: Config,
              rounds: int = 1) -> tuple[dict[str, MethodResult], list[dict]]:
    compute = compute_executor()
    tokenizer = models.load_tokenizer(models.resolve(settings.model, settings.cache_dir))
    prompts = load_prompts(config, tokenizer)
    from specmesh_services.embedded import EmbeddedMesh

    async with contextlib.AsyncExitStack() as stack:
        meshes = {}
        for name, overrides in configs:
            meshes[name] = await stack.enter_async_context(
                EmbeddedMesh.start(settings.with_overrides(**overrides), compute))
            await meshes[name].generate(prompt="warm up", max_tokens=4)
            print(f"loaded {name}", flush=True)
        results = {name: MethodResult(name) for name in meshes}
        rows = []
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                order = list(meshes) if (i + r) % 2 == 0 else list(meshes)[::-1]
                speeds = {}
                for name in order:
                    start = time.perf_counter()
                    out = await meshes[name].generate(max_tokens=config.max_tokens,
                                                      **prompt.request)
                    seconds = time.perf_counter() - start
                    _record(results[name], prompt, out, seconds)
                    speeds[name] = len(out.token_ids) / seconds
                rows.append({"name": prompt.name, "category": prompt.category,
                             "tok_s": {n: speeds[n] for n in meshes}})
                print(f"{prompt.name:14s} {prompt.category:11s} "
                      + "  ".join(f"{n} {speeds[n]:5.1f}" for n in meshes), flush=True)
    return results, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", type=parse_config, metavar="CONFIG",
                        help="NAME[:KEY=VALUE,...]; the first is the reference")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--drafts", nargs="+", default=None,
                        help="draft models (Settings.drafters) [the model's default]")
    parser.add_argument("--draft-vocab", type=int, default=0)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="settings common to every configuration")
    parser.add_argument("--mtbench", type=int, default=8, help="MT-Bench questions [8]")
    parser.add_argument("--humaneval", type=int, default=4, help="HumanEval problems [4]")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts [1]")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    names = [name for name, _ in args.configs]
    if len(set(names)) != len(names):
        parser.error(f"configuration names must differ: {names}")
    try:
        common = parse_overrides(args.set)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    top = {"model": args.model, "dtype": args.dtype, "draft_vocab": args.draft_vocab}
    if args.drafts:
        top["drafters"] = args.drafts
    try:  # every configuration checked before any model loads
        for overrides in [common, *(o for _, o in args.configs)]:
            check_keys(overrides)
        settings = Settings(**top).with_overrides(**common)
        for _, overrides in args.configs:
            settings.with_overrides(**overrides)
    except (ValueError, KeyError) as err:
        parser.error(f"invalid settings: {err}")
    dtype = str(models.resolve_dtype(args.dtype)).removeprefix("torch.")
    config = Config(args.model, "", dtype, mtbench=args.mtbench, humaneval=args.humaneval,
                    max_tokens=args.max_tokens)
    results, rows = asyncio.run(run(settings, args.configs, config, args.rounds))
    report = {"machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d"), "model": args.model, "dtype": dtype,
              "drafts": settings.drafters, "draft_vocab": args.draft_vocab, "common": common,
              "configs": dict(args.configs), "bench": asdict(config),
              "summary": summary(results), "prompts": rows}
    save_report("alternate" + (f"-{args.tag}" if args.tag else ""), report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
