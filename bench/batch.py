"""Throughput under 1 / 4 / 8 concurrent requests (the embedded mesh vs plain batched `generate`),
and packed vs padded batched verification at batch 8 (docs/benchmarks/scripts.md).

    python -m bench.batch                                  # both models, bf16, c = 1,4,8 (~30 min)
    python -m bench.batch --models smollm2-135m --quick    # smoke run, < 3 min
Writes bench/results/batch.json and .md. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import time
from concurrent.futures import Executor
from dataclasses import asdict

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from bench.run import RESULTS, Config, MethodResult, Prompt, _record, load_prompts, mesh_settings
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.serving import compute_executor
from specmesh_services.common.tree import TokenTree, compile_tree
from specmesh.v1 import common_pb2, pool_pb2

NAME = "batch"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
GOAL = (1.3, 1.0)  # target speedup at the largest batch, and at every batch (reported only)
QUICK = {"prompts": 8, "max_tokens": 32, "concurrency": "1,4,8", "reps": 3}
FULL = {"prompts": 16, "max_tokens": 128, "concurrency": "1,4,8", "reps": 10}
# layer-truncated drafts with the best agreement with their target
# (docs/decisions/serving-defaults.md, default drafts)
DRAFTS = {"smollm2-135m": "layers:24", "qwen2.5-coder-0.5b": "layers:20"}


def make_config(model: str, dtype: str, drafts: dict[str, str], args) -> Config:
    humaneval = max(1, args.prompts // 4) if args.prompts > 1 else 0
    draft = drafts.get(model) or DRAFTS.get(model) or models.REGISTRY[model].default_draft
    return Config(model, draft, dtype, args.depth, args.width, mtbench=args.prompts - humaneval,
                  humaneval=humaneval, max_tokens=args.max_tokens)


# --- plain batched transformers ----------
def run_plain(config: Config, prompts: list[Prompt], levels: list[int]) -> dict[int, MethodResult]:
    """`generate` on consecutive batches of c prompts for each c (on the compute thread)."""
    path = models.resolve(config.model, Settings().cache_dir)
    model = models.load_model(path, models.resolve_dtype(config.dtype))
    tokenizer = models.load_tokenizer(path)
    eos = set(models.eos_token_ids(path, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    _generate_batch(model, [prompts[0].ids[:16]] * 2, 4, pad, eos)  # warm-up
    results = {}
    for c in levels:
        result = MethodResult(f"plain-c{c}")
        result.outputs = [[] for _ in prompts]
        for at in tqdm(range(0, len(prompts), c), desc=f"{config.name} plain c={c}", leave=False):
            start = time.perf_counter()
            outs = _generate_batch(model, [p.ids for p in prompts[at:at + c]], config.max_tokens,
                                   pad, eos)
            result.seconds += time.perf_counter() - start
            result.outputs[at:at + len(outs)] = outs
            result.tokens += sum(map(len, outs))
        results[c] = result
    del model
    gc.collect()
    return results


@torch.inference_mode()
def _generate_batch(model, batch: list[list[int]], max_new: int, pad: int, eos: set[int]
                    ) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding: every row's last prompt token at the end
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         pad_token_id=pad)
    return [_until_eos(row[width:].tolist(), eos) for row in out]


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:  # rows are padded after EOS
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


# --- specmesh with c requests in flight ----------
def run_specmesh(config: Config, prompts: list[Prompt], c: int, compute: Executor) -> dict:
    from specmesh_services.launch.embedded import EmbeddedMesh

    async def one(mesh, prompt: Prompt, limit: asyncio.Semaphore, bar):
        async with limit:
            out = await mesh.generate(max_tokens=config.max_tokens, **prompt.request)
            bar.update()
            return out

    async def main() -> dict:
        settings = mesh_settings(config).with_overrides(**{"verifier.batch_size": c})
        async with EmbeddedMesh.start(settings, compute) as mesh:
            await mesh.generate(prompt="warm up", max_tokens=4)
            engine, limit = mesh.worker.engine, asyncio.Semaphore(c)
            passes = engine.steps
            with tqdm(total=len(prompts), desc=f"{config.name} specmesh c={c}", leave=False) as bar:
                start = time.perf_counter()
                outs = await asyncio.gather(*(one(mesh, p, limit, bar) for p in prompts))
                seconds = time.perf_counter() - start
            passes = engine.steps - passes
        result = MethodResult(f"specmesh-c{c}")
        for prompt, out in zip(prompts, outs):
            _record(result, prompt, out, 0.0)
        result.seconds = seconds
        return {"result": result, "verifier_passes": passes}

    out = asyncio.run(main())
    gc.collect()
    return out


# --- padded vs packed verification at batch 8 ----------
def run_padded_vs_packed(config: Config, prompts: list[Prompt], reps: int, batch: int = 8
                         ) -> dict:
    """On the compute thread: the engine's packed step vs a padded HF forward of the same trees."""
    from specmesh_services.verifier.server import build_engine, load_target

    settings = mesh_settings(config).with_overrides(**{"verifier.batch_size": batch})
    lm = load_target(settings)
    engine = build_engine(lm, settings, "bench-packed")
    gen = torch.Generator().manual_seed(0)
    picked = [prompts[i % len(prompts)].ids for i in range(batch)]  # shortened when reused
    prefixes = [ids[:max(8, len(ids) - 7 * (i // len(prompts)))] for i, ids in enumerate(picked)]
    sizes = [4 + (12 * i) // (batch - 1) for i in range(batch)]  # 4 .. 16 nodes
    trees = [random_tree(n, lm.vocab_size, gen) for n in sizes]
    states = [pool_pb2.RequestState(request_id=f"pp-{i}", prompt_ids=ids, model=config.model,
                                    sampling=common_pb2.SamplingParams())
              for i, ids in enumerate(prefixes)]
    packed = _time_packed(engine, states, trees)
    next(packed)  # prefill, not timed
    padded = PaddedBatch(lm, prefixes, trees)
    times: list[tuple[float, float, float]] = []
    for rep in tqdm(range(reps + 1), desc=f"{config.name} padded vs packed", leave=False):
        step_s, forward_s, packed_logits = next(packed)
        padded_s, padded_logits = padded.forward()
        times += [(step_s, forward_s, padded_s)] if rep else []  # the first one warms up
    ms = [1e3 * statistics.median(t) for t in zip(*times)]
    agree = sum(int((a.argmax(-1) == b[:a.shape[0]].argmax(-1)).sum())
                for a, b in zip(packed_logits, padded_logits))
    return {"batch": batch, "prefix_lengths": padded.prefix, "tree_nodes": sizes, "reps": reps,
            "packed_step_ms": ms[0], "packed_forward_ms": ms[1], "padded_forward_ms": ms[2],
            "padded_over_packed_step": ms[2] / ms[0], "padded_over_packed_forward": ms[2] / ms[1],
            "rows_packed": sum(padded.rows), "rows_padded": batch * max(padded.rows),
            "kv_packed": sum(p + m for p, m in zip(padded.prefix, padded.rows)),
            "kv_padded": batch * (max(padded.prefix) + max(padded.rows)),
            "argmax_agree": agree, "argmax_rows": sum(padded.rows)}


def _time_packed(engine, states, trees):
    """Generator: prefills the requests, then per `next` re-loads them at their prompts (the KV
    keeps the prefix: the step computes root + tree) and yields (step s, forward s, logits of
    each request's root + tree rows). The engine's forward is wrapped on this instance only."""
    box, inner = {}, engine.target.forward

    def forward(segments):
        start = time.perf_counter()
        box["logits"] = dict(zip((s.request_id for s in segments), inner(segments)))
        box["seconds"] = time.perf_counter() - start
        return [box["logits"][s.request_id] for s in segments]

    engine.target.forward = forward
    items = [(s.request_id, t) for s, t in zip(states, trees)]
    for s in states:
        engine.load(s, [])
    while any(r.deferred for r in engine.step(items)):  # long prompts prefill in chunks
        pass
    yield None
    while True:
        for s in states:
            engine.load(s, [])
        start = time.perf_counter()
        results = engine.step(items)
        seconds = time.perf_counter() - start
        assert all(r.outcome for r in results), [r.error for r in results]
        yield seconds, box["seconds"], [box["logits"][s.request_id] for s in states]


def random_tree(n: int, vocab: int, gen: torch.Generator) -> TokenTree:
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    return TokenTree(tuple(tokens), tuple(parents))


class PaddedBatch:
    """The conventional way: prefixes left-padded to the longest in one DynamicCache, the trees'
    rows right-padded to the largest, a 4D additive mask [B, 1, M, P + M], per-row positions."""

    def __init__(self, lm, prefixes: list[list[int]], trees: list[TokenTree]) -> None:
        from transformers import DynamicCache

        self.lm = lm
        self.prefix = [len(ids) - 1 for ids in prefixes]  # committed rows; the last is the root
        compiled = [compile_tree(t, ids[-1]) for t, ids in zip(trees, prefixes)]
        self.rows = [c.num_rows for c in compiled]
        b, p, m = len(prefixes), max(self.prefix), max(self.rows)
        low = torch.finfo(lm.dtype).min
        self.ids = torch.zeros(b, m, dtype=torch.long)
        self.pos = torch.zeros(b, m, dtype=torch.long)
        self.mask = torch.full((b, 1, m, p + m), low, dtype=lm.dtype)
        self.cache = DynamicCache(config=lm.config)
        caches = [lm.new_cache() for _ in prefixes]
        for i, (ids, c) in enumerate(zip(prefixes, compiled)):
            n, start = c.num_rows, p - self.prefix[i]
            self.ids[i, :n], self.pos[i, :n] = c.tokens, self.prefix[i] + c.depths
            self.pos[i, n:] = self.prefix[i]
            self.mask[i, 0, :n, start:p] = 0
            self.mask[i, 0, :n, p:p + n].masked_fill_(c.ancestors, 0)
            self.mask[i, 0, torch.arange(n, m), p + torch.arange(n, m)] = 0  # pad rows: self
            lm.prefill(caches[i], ids[:-1])
        for layer in range(lm.num_layers):  # zeros left of each prefix
            k, v = (torch.cat([F.pad(kv.tensors()[layer][j], (0, 0, p - len(kv), 0))
                               for kv in caches]) for j in (0, 1))
            self.cache.update(k, v, layer)
        self.past = p

    @torch.inference_mode()
    def forward(self) -> tuple[float, torch.Tensor]:
        """One padded forward (timed); the cache is cropped back afterwards. -> (s, logits)."""
        m = self.ids.shape[1]
        start = time.perf_counter()
        out = self.lm.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                            past_key_values=self.cache, use_cache=True,
                            cache_position=torch.arange(self.past, self.past + m))
        seconds = time.perf_counter() - start
        self.cache.crop(-m)  # drop the new rows again
        return seconds, out.logits.float()


# --- one model x dtype, report ----------
def run_config(config: Config, levels: list[int], reps: int, compute: Executor,
               padded: bool) -> dict:
    tokenizer = models.load_tokenizer(models.resolve(config.model, Settings().cache_dir))
    prompts = load_prompts(config, tokenizer)
    plain = compute.submit(run_plain, config, prompts, sorted(set(levels) | {1})).result()
    reference = plain[1].outputs
    rows = []
    for c in levels:
        mesh = run_specmesh(config, prompts, c, compute)
        spec, base = mesh["result"], plain[c]
        rows.append({"concurrency": c, "plain_tok_s": base.tok_s, "specmesh_tok_s": spec.tok_s,
                     "speedup": spec.tok_s / base.tok_s if base.tok_s else None,
                     "accepted_length": spec.mean_accepted_length,
                     "trees_per_pass": spec.target_forwards / max(1, mesh["verifier_passes"]),
                     "plain_identical": _same(base.outputs, reference),
                     "specmesh_identical": _same(spec.outputs, reference),
                     "plain": asdict(base), "specmesh": asdict(spec)})
    report = {"config": asdict(config), "prompts": [p.name for p in prompts], "rows": rows}
    if padded:
        report["padded_vs_packed"] = compute.submit(run_padded_vs_packed, config, prompts,
                                                    reps).result()
    gc.collect()
    return report


def _same(outputs: list[list[int]], reference: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(outputs, reference))


def markdown(report: dict) -> str:
    c, n = report["config"], len(report["prompts"])
    lines = [f"### {c['model']}, {c['dtype']}, draft `{c['draft']}`, depth {c['depth']} width "
             f"{c['width']}, {n} prompts x {c['max_tokens']} tokens", "",
             "| concurrency | plain batched tok/s | specmesh tok/s | speedup | accepted length "
             "| trees per verify pass | identical to plain batch-1 (plain / specmesh) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['concurrency']} | {r['plain_tok_s']:.2f} | {r['specmesh_tok_s']:.2f} "
                     f"| {r['speedup']:.2f}x | {r['accepted_length']:.2f} "
                     f"| {r['trees_per_pass']:.2f} | {r['plain_identical']}/{n} / "
                     f"{r['specmesh_identical']}/{n} |")
    lines += ["", _goal(report["rows"])]
    pp = report.get("padded_vs_packed")
    if pp:
        lines += ["", f"Verification at batch {pp['batch']} (prefixes {pp['prefix_lengths']}, "
                  f"trees of {pp['tree_nodes']} nodes, median of {pp['reps']}):", "",
                  "| | new rows | KV positions read | ms per step |", "|---|---:|---:|---:|",
                  *(f"| {title} | {pp['rows_' + kind]} | {pp['kv_' + kind]} | {pp[key]:.1f} |"
                    for title, kind, key in (
                        ("packed, engine step", "packed", "packed_step_ms"),
                        ("packed, forward only", "packed", "packed_forward_ms"),
                        ("padded HF forward", "padded", "padded_forward_ms"))), "",
                  f"padded / packed: {pp['padded_over_packed_step']:.2f}x the engine step, "
                  f"{pp['padded_over_packed_forward']:.2f}x the forward; same argmax on "
                  f"{pp['argmax_agree']}/{pp['argmax_rows']} real rows."]
    return "\n".join(lines) + "\n"


def _goal(rows: list[dict]) -> str:
    top = max(rows, key=lambda r: r["concurrency"])
    low = min(rows, key=lambda r: r["speedup"])
    ok = top["speedup"] >= GOAL[0] and low["speedup"] >= GOAL[1]
    return (f"Goal: >= {GOAL[0]}x plain at batch {top['concurrency']}, "
            f"never below {GOAL[1]}x. Here: {top['speedup']:.2f}x at batch {top['concurrency']}, "
            f"lowest {low['speedup']:.2f}x (batch {low['concurrency']}): "
            f"{'met' if ok else 'not met'}.")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"[{','.join(MODELS)}]")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "both"), default="bfloat16")
    parser.add_argument("--concurrency", help=f"[{FULL['concurrency']}]")
    parser.add_argument("--prompts", type=int, help=f"prompts, 3/4 MT-Bench [{FULL['prompts']}]")
    parser.add_argument("--max-tokens", type=int, help=f"[{FULL['max_tokens']}]")
    parser.add_argument("--draft", default="", help="model=spec,... or one spec for all "
                        f"[{','.join(f'{m}={d}' for m, d in DRAFTS.items())}]")
    speculation = Settings().speculation
    parser.add_argument("--depth", type=int, default=speculation.depth)
    parser.add_argument("--width", type=int, default=speculation.width)
    parser.add_argument("--reps", type=int, help=f"padded vs packed repetitions [{FULL['reps']}]")
    parser.add_argument("--no-padded", action="store_true", help="skip padded vs packed")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def header(title: str, quick: bool) -> str:
    return (f"specmesh {title} — {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}{', --quick' if quick else ''}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    names = [m for m in args.models.split(",") if m]
    pairs = [d.split("=", 1) for d in args.draft.split(",") if d]
    drafts = dict(pairs) if all(len(p) == 2 for p in pairs) else dict.fromkeys(names, args.draft)
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    configs = [make_config(m, d, drafts, args) for m in names for d in dtypes]
    RESULTS.mkdir(parents=True, exist_ok=True)
    compute, reports, texts = compute_executor(), [], []
    for config in configs:
        reports.append(run_config(config, levels, args.reps, compute, not args.no_padded))
        texts.append(markdown(reports[-1]))
        print(texts[-1], flush=True)
        (RESULTS / f"{NAME}.json").write_text(json.dumps(reports, indent=1))
        (RESULTS / f"{NAME}.md").write_text(header(f"`{NAME}`", args.quick) + "\n"
                                             + "\n".join(texts))
    print(f"written: {RESULTS / NAME}.json, .md")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
