"""Draft heads served by the verifier, beside the mesh's other sources and plain decoding, each
mode bracketed by plain runs; `--hop` what a heads service of its own would add a step
(docs/benchmarks/scripts.md).

    python -m bench.heads                                  # SmolLM2, batches 1 and 8
    python -m bench.heads --heads heads:/path/to/heads --modes heads --batches 1
Writes bench/results/heads-<model>[-<tag>].json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

from bench.router import run_mesh
from bench.run import Config, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import PLAIN_DECODING, Settings
from specmesh_services.common.serving import compute_executor

MODES = ("default", "heads", "heads+datastore")


def prune_settings(settings: Settings, prune: str) -> Settings:
    """`prune`: off, or n:k = the cached early head of layer n (`specmesh heads early`) with
    Top-k."""
    if prune == "off":
        return settings.with_overrides(**{"verifier.prune": "off"})
    layer, k = (int(x) for x in prune.split(":"))
    return settings.with_overrides(**{"verifier.prune": "on", "verifier.prune_layer": layer,
                                      "verifier.prune_top_k": k})


def mode_settings(base: Settings, mode: str, heads: str) -> Settings:
    if mode == "plain":
        return base.with_overrides(**PLAIN_DECODING)
    if mode == "default":
        return base
    source = "both" if mode == "heads+datastore" else "model"
    return base.with_overrides(drafters=[heads], **{"speculation.source": source})


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def hop(hidden_size: int, calls: int = 2000) -> dict:
    """Median and p90 seconds of a gRPC unary round trip on this host carrying a hidden state
    ([hidden_size] bfloat16) out and an 8-node token tree back."""
    import grpc

    from specmesh.v1 import common_pb2

    tree = common_pb2.TokenTree(tokens=list(range(8)), parents=[-1, 0, 1, 2, -1, 4, 5, 6],
                                scores=[0.5] * 8).SerializeToString()

    async def run() -> list[float]:
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: tree)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.Heads", {"Draft": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        payload = bytes(2 * hidden_size)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/bench.Heads/Draft")
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                await call(payload)
                times.append(time.perf_counter() - start)
        await server.stop(None)
        return times[calls // 10:]  # after the warm-up
    times = sorted(asyncio.run(run()))
    return {"median_ms": round(1e3 * statistics.median(times), 3),
            "p90_ms": round(1e3 * times[int(0.9 * len(times))], 3), "calls": calls}


def accuracy(model: str, dtype: str, prompts, max_tokens: int, folders: list[str]) -> list:
    """Hydra's figure 2 on the bench prompts: per heads folder (under the model's heads
    cache, or a path) and head, top-1 / top-5 accuracy against the target's own greedy
    continuation of each prompt (what a greedy verification accepts), teacher-forced."""
    import torch
    from safetensors.torch import load_file

    from specmesh_services.heads.model import GroundedHeads

    settings = Settings(model=model, dtype=dtype)
    path = models.resolve(model, settings.cache_dir)
    target = models.load_model(path, models.resolve_dtype(dtype), linear="torch")
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    states, tokens = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.ids])
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_tokens, min_new_tokens=max_tokens)
            hidden = target.model(input_ids=out).last_hidden_state[0]
            start = len(p.ids) - 1  # f_t from the last prompt token on: the served steps
            states.append(hidden[start:])
            tokens.append(out[0, start:])
    rows = []
    for folder in folders:
        where = Path(folder) if "/" in folder else settings.cache_dir / "heads" / model / folder
        meta = json.loads((where / "heads.json").read_text())
        weights = load_file(str(where / "heads.safetensors"))
        heads = GroundedHeads(meta["hidden_size"], meta["num_heads"], embed, lm_head,
                              meta.get("grounded", True), weights.get("vocab"))
        heads.load_state_dict(weights, strict=False)
        hits = [[0, 0, 0] for _ in range(heads.num_heads)]
        with torch.inference_mode():
            for f, x in zip(states, tokens):
                for k in range(1, heads.num_heads + 1):
                    n = len(x) - 1 - k  # positions with x_{t+1..t+1+k} known
                    if n < 1:
                        continue
                    inputs = torch.stack([x[1 + j:1 + j + n] for j in range(k)], 1)
                    top = heads.vocab[heads.logits(k, f[:n], inputs).topk(5, -1).indices]
                    want = x[1 + k:1 + k + n].unsqueeze(1)
                    hits[k - 1][0] += int((top[:, :1] == want).sum())
                    hits[k - 1][1] += int((top == want).any(-1).sum())
                    hits[k - 1][2] += n
        for k, (h1, h5, n) in enumerate(hits, 1):
            rows.append({"heads": folder, "grounded": meta.get("grounded", True),
                         "targets": meta.get("targets", "data"), "head": k,
                         "top1": round(h1 / n, 3), "top5": round(h5 / n, 3), "positions": n})
    return rows


def draft_time(model: str, heads: str, calls: int = 100) -> list[dict]:
    """Milliseconds of one heads tree (8 nodes, batch 1 and 8) by the heads' weights and the
    frontier expanded per level."""
    import torch

    from specmesh_services.common.datastore_files import tokenizer_family
    from specmesh_services.common.drafts import heads_path
    from specmesh_services.heads import draft

    settings = Settings(model=model)
    path = models.resolve(model, settings.cache_dir)
    target = models.load_model(path, models.resolve_dtype("auto"), linear="torch")
    folder = heads_path(heads) or draft.default_folder(settings, model)
    family = tokenizer_family(models.load_tokenizer(path))
    rows, frontier = [], draft.FRONTIER
    for weights in ("int8", "int4", None):
        drafter = draft.HeadsDrafter.load(folder, model, family,
                                          target.get_input_embeddings().weight.detach(),
                                          target.get_output_embeddings().weight.detach(), weights)
        for width in (4, 2):
            draft.FRONTIER = width
            for batch in (1, 8):
                f = torch.randn(batch, target.config.hidden_size)
                for _ in range(5):
                    drafter.draft(f, [100] * batch, [8] * batch)
                start = time.perf_counter()
                for _ in range(calls):
                    drafter.draft(f, [100] * batch, [8] * batch)
                rows.append({"weights": drafter.weights, "frontier": width, "batch": batch,
                             "ms": round(1e3 * (time.perf_counter() - start) / calls, 3)})
    draft.FRONTIER = frontier
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--heads", default="heads", help="the heads spec [heads: the model's]")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--mtbench", type=int, default=8)
    parser.add_argument("--humaneval", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="settings for every mode (e.g. speculation.max_nodes=8)")
    parser.add_argument("--tag", default="", help="suffix of the report's name")
    parser.add_argument("--hop", action="store_true",
                        help="only time a heads service's gRPC round trip (see above)")
    parser.add_argument("--accuracy", nargs="+", metavar="HEADS",
                        help="only the heads' accuracy on the prompts' greedy continuations "
                             "(folders under the model's heads cache, or paths)")
    parser.add_argument("--prune", nargs="+", metavar="N:K",
                        help="run each mode with each early pruning setting: off, or n:k (the "
                             "early head of layer n, Top-k); adds prune rate to the rows")
    parser.add_argument("--draft-time", action="store_true",
                        help="only time one heads tree by weights and frontier (see above)")
    args = parser.parse_args(argv)
    if args.draft_time:
        for row in draft_time(args.model, args.heads):
            print({"host": cpu(), **row})
        return 0
    if args.hop:
        config = models.load_config(models.resolve(args.model, Settings().cache_dir))
        print({"host": cpu(), "model": args.model, **hop(config.hidden_size)})
        return 0
    overrides = dict(item.split("=", 1) for item in args.set)
    base = Settings(model=args.model, dtype=args.dtype).with_overrides(**overrides)
    dtype = str(models.resolve_dtype(args.dtype)).removeprefix("torch.")
    config = Config(args.model, "", dtype, mtbench=args.mtbench, humaneval=args.humaneval,
                    max_tokens=args.max_tokens)
    tokenizer = models.load_tokenizer(models.resolve(args.model, base.cache_dir))
    prompts = load_prompts(config, tokenizer)
    if args.accuracy:
        rows = accuracy(args.model, args.dtype, prompts, args.max_tokens, args.accuracy)
        for row in rows:
            print(row)
        return 0
    compute = compute_executor()
    report = {"host": cpu(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
              "dtype": dtype, "heads": args.heads, "settings": overrides,
              "prompts": [p.name for p in prompts], "max_tokens": args.max_tokens, "rows": []}

    def run(mode: str, batch: int, prune: str = "off"):
        start = {}

        def started(mesh) -> None:  # counters from here: the warm-up is not measured
            engine = mesh.worker.engine
            pruner = engine.target.pruner
            start.update(engine=engine, heads=engine.heads_seconds, steps=engine.steps,
                         nodes=pruner.nodes if pruner else 0, pruned=pruner.pruned if pruner else 0)
        result = run_mesh(config, prompts, prune_settings(mode_settings(base, mode, args.heads),
                                                          prune), batch, compute, mode,
                          on_start=started)
        engine = start["engine"]
        pruner = engine.target.pruner
        rate = ((pruner.pruned - start["pruned"]) / max(pruner.nodes - start["nodes"], 1)
                if pruner else 0.0)
        return result, engine.heads_seconds - start["heads"], engine.steps - start["steps"], rate

    runs = [(mode, prune) for mode in args.modes for prune in (args.prune or ["off"])]
    for batch in args.batches:
        before = run("plain", batch)[0]
        for mode, prune in runs:
            result, heads_s, steps, rate = run(mode, batch, prune)
            after = run("plain", batch)[0]
            plain = (before.tok_s + after.tok_s) / 2
            same = sum(a == b for a, b in zip(result.outputs, before.outputs))
            row = {"mode": mode, "prune": prune, "prune_rate": round(rate, 3), "batch": batch,
                   "tok_s": round(result.tok_s, 2),
                   "plain_tok_s": round(plain, 2), "ratio": round(result.tok_s / plain, 3),
                   "tokens_per_step": round(result.mean_accepted_length, 2),
                   "nodes_per_step": round(result.draft_tokens / max(result.target_forwards, 1),
                                           2),
                   "heads_ms_per_step": round(1e3 * heads_s / max(steps, 1), 3),
                   "identical_to_plain": f"{same}/{len(prompts)}"}
            report["rows"].append(row)
            print(row, flush=True)
            before = after
    lines = [f"{args.model}, {dtype}, {report['host']}, {report['date']}: {len(prompts)} "
             f"prompts x {args.max_tokens} tokens, heads `{args.heads}`",
             "", "| mode | prune (layer:k) | prune rate | batch | tok/s | plain tok/s | ratio | "
             "tokens/step | nodes/step | heads ms/step | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['prune']} | {r['prune_rate']} | {r['batch']} | {r['tok_s']} | "
              f"{r['plain_tok_s']} | {r['ratio']} "
              f"| {r['tokens_per_step']} | {r['nodes_per_step']} | {r['heads_ms_per_step']} | "
              f"{r['identical_to_plain']} |" for r in report["rows"]]
    save_report(f"heads-{args.model}" + (f"-{args.tag}" if args.tag else ""), report,
                "\n".join(lines) + "\n")
    compute.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
