"""How often draft models guess the target's next token, and their time per drafting forward.

For each draft spec (`@int4`, `@int8`, `@auto`, a `/full` suffix to keep the whole vocabulary
where `--draft-vocab` restricts it): one forward of the draft over prompt + the target's own
greedy continuation (teacher forcing), and per position whether the draft's top token is the
target's. Reports the top-1 agreement, the expected drafted tokens a greedy chain of depth d
would have accepted (min(run of agreements from that position, d), averaged over positions),
per prompt class the depth-4 figure, and the draft's milliseconds per drafting forward
(`DraftModel.measure`). With the target's measured forward time for 1..9 rows it also gives
the batch-1 speedup ceilings of drafting with each draft (`oracle_speedup`): what an oracle
that drafts exactly the tokens the target accepts would get, for chains (top-1 agreement) and
for trees of width 4 (top-4 agreement); no stopping rule, tree shape or router can beat them.
The draft runs the forward the drafter serves with (`draft_runner`: the lean decoder loop
where it applies). This is the draft's side of the speedup, without the mesh: which draft
weights guess well enough for their cost on this CPU.

    python -m bench.agreement --draft-vocab 32768 \\
        --drafts qwen2.5-coder-0.5b@int4 qwen2.5-coder-0.5b@int8 qwen2.5-coder-0.5b
    python -m bench.agreement --quick                  # 3 + 1 prompts x 16 tokens
Writes bench/results/agreement-<model>-<dtype>[-<tag>].json and .md (run it alone on the machine).
"""
from __future__ import annotations

import argparse
import gc
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from bench.batch import header
from bench.linear import step_ms
from bench.run import Config, _hf_generate, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.drafter.engine import DraftModel
from specmesh_services.drafter.models import DraftSpec, draft_vocabulary, load_draft_lm

DEPTHS = (2, 4, 8)
CEILING_DEPTH = 8  # deepest draft of the oracle ceilings
TREE_WIDTH = 4  # candidates per level of the oracle tree ceiling


def accepted_runs(agree: list[bool], depth: int) -> list[int]:
    """Per position: the drafted tokens a chain of `depth` started there would have had
    accepted (consecutive agreements, at most `depth`)."""
    out = []
    for i in range(len(agree)):
        k = 0
        while k < depth and i + k < len(agree) and agree[i + k]:
            k += 1
        out.append(k)
    return out


def oracle_speedup(agrees: list[list[bool]], depth: int, draft_ms: float,
                   verify_ms: dict[int, float]) -> float:
    """Upper bound of batch-1 speedup over plain decoding for drafting with this draft, whatever
    the stopping rule or tree shape, without any serving overhead. An oracle steps through each
    target output: at position i it drafts exactly the k = min(run of agreements from i, depth)
    tokens the target will accept (none if k = 0; it never drafts a rejected token), then one
    target forward of k + 1 rows emits k + 1 tokens. Cost: k draft forwards + verify_ms[k + 1];
    plain decoding: verify_ms[1] per token. With `agrees` from top-1 agreement this bounds every
    chain policy; from top-K agreement (the target's token among the draft's K best) it bounds
    trees of width K, counting one draft forward per level and no verify rows for siblings, so
    it is generous to trees."""
    tokens = seconds = 0.0
    for agree in agrees:
        runs, i = accepted_runs(agree, depth), 0
        while i < len(agree):
            k = runs[i]
            tokens += k + 1
            seconds += k * draft_ms + verify_ms[k + 1]
            i += k + 1
    return tokens * verify_ms[1] / seconds if seconds else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                        help="the target's dtype and that of unquantized drafts [bfloat16]")
    parser.add_argument("--drafts", nargs="+", metavar="SPEC",
                        default=["qwen2.5-coder-0.5b@int4", "qwen2.5-coder-0.5b@int8"],
                        help="draft specs; SPEC/full keeps the whole vocabulary")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="restrict the drafts' heads to the N most frequent tokens [0: all]")
    parser.add_argument("--mtbench", type=int, default=16, help="MT-Bench questions [16]")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval problems [8]")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="3 + 1 prompts x 16 tokens")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    if args.quick:
        args.mtbench, args.humaneval, args.max_tokens = 3, 1, 16
    dtype = models.resolve_dtype(args.dtype)
    settings = Settings(model=args.model, dtype=str(dtype).removeprefix("torch."),
                        draft_vocab=args.draft_vocab)
    target_path = models.resolve(args.model, settings.cache_dir)
    tokenizer = models.load_tokenizer(target_path)
    config = Config(args.model, "", settings.dtype, mtbench=args.mtbench,
                    humaneval=args.humaneval, max_tokens=args.max_tokens)
    prompts = load_prompts(config, tokenizer)

    target = models.load_model(target_path, dtype)
    outputs = [_hf_generate(target, p.ids, args.max_tokens, tokenizer.eos_token_id, {})
               for p in tqdm(prompts, desc="target greedy", leave=False)]
    # the target's forward of n rows (root + n - 1 drafted) at the prompts' mean length
    context = round(sum(len(p.ids) for p in prompts) / len(prompts))
    verify_ms = step_ms(target, context, list(range(1, CEILING_DEPTH + 2)), reps=5)
    del target
    gc.collect()

    keep = draft_vocabulary(settings, target_path) if args.draft_vocab else None
    rows = []
    for name in tqdm(args.drafts, desc="drafts", leave=False):
        base, _, suffix = name.partition("/")
        spec = DraftSpec.parse(base)
        # the forward the drafter serves with (lean.py where it applies), timed and scored
        lm = load_draft_lm(spec, settings, target_path, name, None if suffix == "full" else keep)
        draft = DraftModel(lm, name, "model")
        ms = 1e3 * draft.measure()
        columns = getattr(lm, "token_ids", None)  # a lean forward's logits: draft vocabulary
        hits = total = 0
        agrees: list[list[bool]] = []
        agrees_top: list[list[bool]] = []  # the target's token among the draft's TREE_WIDTH best
        runs: dict[int, list[int]] = defaultdict(list)
        by_class: dict[str, list[int]] = defaultdict(list)
        with torch.inference_mode():
            for p, target_out in zip(prompts, outputs):
                if not target_out:
                    continue
                logits = lm.forward(lm.new_cache(), torch.tensor(p.ids + target_out))
                scores = logits[len(p.ids) - 1:-1]
                top = scores.topk(TREE_WIDTH, dim=-1).indices  # [n, K], best first
                top = top if columns is None else columns[top]
                guess = top[:, 0].tolist()
                agree = [a == b for a, b in zip(guess, target_out)]
                wanted = torch.tensor(target_out)
                agrees.append(agree)
                agrees_top.append((top == wanted[:, None]).any(-1).tolist())
                hits, total = hits + sum(agree), total + len(agree)
                for d in DEPTHS:
                    runs[d] += accepted_runs(agree, d)
                by_class[p.category] += accepted_runs(agree, 4)
        rows.append({"draft": name, "weights": spec.quantized() or settings.dtype,
                     "ms_per_forward": ms, "top1": hits / max(total, 1),
                     "accepted": {d: sum(v) / max(len(v), 1) for d, v in runs.items()},
                     "ceiling_chain": oracle_speedup(agrees, CEILING_DEPTH, ms, verify_ms),
                     "ceiling_tree": oracle_speedup(agrees_top, CEILING_DEPTH, ms, verify_ms),
                     "accepted_d4_by_class": {c: sum(v) / len(v) for c, v in by_class.items()}})
        del draft, lm
        gc.collect()

    name = f"agreement-{args.model}-{settings.dtype}" + (f"-{args.tag}" if args.tag else "")
    report = {"config": vars(args), "prompts": [p.name for p in prompts], "drafts": rows,
              "verify_ms": verify_ms, "context": context}
    classes = sorted({c for r in rows for c in r["accepted_d4_by_class"]})
    lines = [header(f"draft agreement with {args.model} ({settings.dtype}), {len(prompts)} "
                    f"prompts x {args.max_tokens} tokens"
                    + (f", draft vocabulary {args.draft_vocab}" if args.draft_vocab else ""),
                    args.quick),
             "", "| draft | weights | ms / forward | top-1 | "
             + " | ".join(f"accepted d{d}" for d in DEPTHS) + " | ceiling chain | "
             f"ceiling top-{TREE_WIDTH} tree | " + " | ".join(f"{c} d4" for c in classes) + " |",
             "|---|---|---:|---:|" + "---:|" * (len(DEPTHS) + 2 + len(classes))]
    for r in rows:
        lines.append(f"| {r['draft']} | {r['weights']} | {r['ms_per_forward']:.1f} | "
                     f"{r['top1']:.3f} | "
                     + " | ".join(f"{r['accepted'][d]:.2f}" for d in DEPTHS) + " | "
                     + f"{r['ceiling_chain']:.2f}x | {r['ceiling_tree']:.2f}x | "
                     + " | ".join(f"{r['accepted_d4_by_class'].get(c, 0):.2f}" for c in classes)
                     + " |")
    lines += ["", f"Target forward of n rows after {context} cached tokens (ms): "
              + ", ".join(f"{n}: {t:.1f}" for n, t in verify_ms.items()) + ".",
              f"Ceilings: batch-1 speedup an oracle would get with this draft (depth <= "
              f"{CEILING_DEPTH}; `oracle_speedup`), no serving overhead."]
    save_report(name, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
