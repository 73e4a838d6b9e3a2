"""What batching the drafter's work saves: b requests drafted by one `draft_many` call (one
forward per tree level for all of them) vs the same b requests drafted one call each.

For each batch size b: b MT-Bench prompts are prefilled on the draft model, then every request
drafts a tree (depth x width) after committing one accepted token and a bonus token, `--reps`
times; median milliseconds per round of b trees, batched and one by one, and the ratio.

    python -m bench.draft_batch                               # the 1.5B's 0.5B draft, fp32
    python -m bench.draft_batch --model smollm2-135m --draft layers:8 --batches 1,4,8
Writes bench/results/draft-batch-<draft>-<dtype>.json and .md (run it alone on the machine).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm

from bench.batch import header
from bench.run import save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.prompts import mtbench_questions
from specmesh_services.drafter.models import build_draft_models


def round_ms(draft, prompts: list[list[int]], depth: int, width: int, reps: int,
             batched: bool) -> float:
    """Median ms of one round in which every prompt's request drafts a tree."""
    ids = [f"{'b' if batched else 's'}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        draft.prefill(rid, prompt)
    new = {rid: [] for rid in ids}
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        if batched:
            trees = [t for t, _ in draft.draft_many([(r, new[r], depth, width) for r in ids])]
        else:
            trees = [draft.draft(r, new[r], depth, width)[0] for r in ids]
        if rep:  # the first round warms the shapes up
            times.append((time.perf_counter() - start) * 1e3)
        for rid, tree in zip(ids, trees):  # accept the first node, then a bonus token
            new[rid] = [tree.tokens[0], tree.tokens[-1]]
    for rid in ids:
        draft.release(rid)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b",
                        help="draft model spec (layers:N or a model name)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batches", default="1,2,4,8", help="requests per round")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    settings = Settings().with_overrides(model=args.model, dtype=args.dtype,
                                         drafters=[args.draft])
    draft = build_draft_models(settings)[0]
    tokenizer = models.load_tokenizer(models.resolve(args.model, settings.cache_dir))
    questions = mtbench_questions()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                           tokenize=False, add_generation_prompt=True)
             for q in questions[::10][:max(batches)]]
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    rows = []
    with torch.inference_mode():
        for b in tqdm(batches, desc="batch sizes"):
            alone = round_ms(draft, prompts[:b], args.depth, args.width, args.reps, False)
            together = round_ms(draft, prompts[:b], args.depth, args.width, args.reps, True)
            rows.append({"batch": b, "one_by_one_ms": alone, "batched_ms": together})
    report = {"model": args.model, "draft": args.draft, "dtype": args.dtype,
              "depth": args.depth, "width": args.width, "reps": args.reps, "rows": rows}
    lines = [header(f"batched drafting, {args.draft} ({args.dtype}), depth {args.depth} x "
                    f"width {args.width}", False), "",
             "| requests | one call each (ms per round) | one batched call (ms) | ratio |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['one_by_one_ms']:.0f} | {r['batched_ms']:.0f} | "
                     f"{r['one_by_one_ms'] / r['batched_ms']:.2f}x |")
    name = f"draft-batch-{args.draft.replace(':', '')}-{args.dtype}"
    save_report(name, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
