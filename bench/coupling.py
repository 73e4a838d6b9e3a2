"""Which acceptance rule a sampled request's drafts should be verified under: the expected share
of drafted tokens accepted per position, per rule, on the target's own sampled continuations.

For each prompt the target samples a continuation (temperature T, top-k, top-p, a fixed seed);
target and draft then run one teacher-forced forward over prompt + continuation, and at each
position p (the target's processed distribution) and q (the draft's, processed the same way)
give, for a chain's first token and for a level of 4 candidates:
  uncoupled   the draft's likeliest token(s), accepted when the target's draw is one of them:
              sum of p over the draft's top-1 (top-4) tokens
  coupled     the draft races q with the target's random numbers (`sampling.coupled_scores`):
              P(the target's race winner is the draft's winner (among its 4 first)), Monte
              Carlo over --draws race weights
  rejection   speculative sampling (min(1, p/q), residual p - q): sum min(p, q); for 4
              candidates drawn without replacement, recursive rejection sampling (accept x_i
              with min(1, p_i/q_i); p_i+1 = norm(max(0, p_i - q_i)), q_i+1 = q without the
              drawn ones), the chance one is accepted averaged over --draws draws
and, on the greedy continuation of the same prompts, the greedy agreement (top-1 and among the
draft's 4 best). Chat (MT-Bench) and code (HumanEval) apart.

With --serve, the same prompts go through an embedded mesh at the serving defaults, drafted by
the draft model (speculation.source=model), instead:
greedy, then sampled with coupled drafting (the default), then sampled with it off
(`speculation.coupled=false`: the draft's likeliest tokens); per mode and prompt class the share
of drafted tokens accepted ((tokens - steps) / tree nodes) and the tokens per step.

    python -m bench.coupling --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    python -m bench.coupling --serve --model qwen2.5-coder-1.5b --dtype bfloat16
Writes bench/results/coupling-<model>-<dtype>[-serve][-<tag>].json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from bench.batch import header
from bench.run import Config, _hf_generate, load_prompts, save_report
from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.sampling import (Sampler, SamplingParams, coupled_scores,
                                               probabilities, race_weights)
from specmesh_services.drafter.models import DraftSpec, load_draft_lm

WIDTH = 4
RULES = ("greedy", "uncoupled", "coupled", "rejection")


def sampled_continuation(model, ids: list[int], n: int, sampler: Sampler, eos: int) -> list[int]:
    """The target's own sampled continuation (the plain sampler, one forward per token)."""
    out: list[int] = []
    past = None
    x = torch.tensor([ids])
    for _ in range(n):
        result = model(input_ids=x, past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = sampler.sample(result.logits[0, -1], len(ids) + len(out))
        out.append(token)
        if token == eos:
            break
        x = torch.tensor([[token]])
    return out


def rejection_accepts(p: torch.Tensor, q: torch.Tensor, drawn: list[int]) -> float:
    """The chance recursive rejection sampling accepts one of `drawn` (drawn from q in this
    order without replacement): 1 - the product of the stages' rejection chances."""
    reject = 1.0
    for x in drawn:
        if q[x] <= 0:
            break
        accept = min(1.0, float(p[x] / q[x]))
        reject *= 1.0 - accept
        if reject == 0.0:
            break
        p = torch.clamp(p - q, min=0.0)
        p = p / p.sum()
        q = q.clone()
        q[x] = 0.0
        if q.sum() <= 0:
            break
        q = q / q.sum()
    return 1.0 - reject


def position_rates(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int
                   ) -> dict[str, tuple[float, float]]:
    """(chain, 4-wide level) acceptance of one position under each sampled rule."""
    top = torch.topk(q, WIDTH).indices
    uncoupled = (float(p[top[0]]), float(p[top].sum()))
    chain = level = rej_level = 0.0
    for d in range(draws):
        weights = race_weights(seed, d, p.numel())
        target = int(torch.argmax(coupled_scores(p, weights)))
        ranked = torch.topk(coupled_scores(q, weights), WIDTH).indices.tolist()
        chain += target == ranked[0]
        level += target in ranked
        rej_level += rejection_accepts(p, q, ranked)  # ranked = 4 draws without replacement
    return {"uncoupled": uncoupled, "coupled": (chain / draws, level / draws),
            "rejection": (float(torch.minimum(p, q).sum()), rej_level / draws)}


def serve_rates(args, prompts, params: SamplingParams) -> dict:
    """Per mode and prompt class: drafted tokens accepted / drafted, tokens per step."""
    from specmesh_services.common.serving import compute_executor
    from specmesh_services.embedded import EmbeddedMesh

    # the draft model drafts every step (the model's default source may be the datastore,
    # whose lookups are drafted the same way sampled or not)
    settings = Settings(model=args.model, dtype=args.dtype, drafters=[args.draft]
                        ).with_overrides(**{"speculation.source": "model"})
    modes = {"greedy": ({}, {}),
             "coupled": ({"temperature": params.temperature, "top_p": params.top_p,
                          "top_k": params.top_k}, {}),
             "uncoupled": ({"temperature": params.temperature, "top_p": params.top_p,
                            "top_k": params.top_k}, {"speculation.coupled": False})}

    async def run(sampling: dict, overrides: dict) -> dict:
        sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # tokens, steps, nodes
        async with EmbeddedMesh.start(settings.with_overrides(**overrides), compute) as mesh:
            for i, p in enumerate(tqdm(prompts, desc=str(sampling or "greedy"), leave=False)):
                out = await mesh.generate(max_tokens=args.max_tokens, seed=i, **sampling,
                                          **p.request)
                kind = "code" if p.category == "code" else "chat"
                for key in (kind, "all"):
                    sums[key][0] += len(out.token_ids)
                    sums[key][1] += out.stats.steps
                    sums[key][2] += out.stats.draft_tokens
        return {kind: {"accepted_share": (t - s) / n if n else 0.0, "tokens_per_step": t / s,
                       "draft_tokens": n} for kind, (t, s, n) in sums.items()}

    compute = compute_executor()
    try:
        return {mode: asyncio.run(run(*modes[mode])) for mode in modes}
    finally:
        compute.shutdown()


def serve_report(args, prompts, params: SamplingParams) -> int:
    rates = serve_rates(args, prompts, params)
    name = f"coupling-{args.model}-{args.dtype}-serve" + (f"-{args.tag}" if args.tag else "")
    lines = [header(f"drafted tokens accepted through the mesh, target {args.model} "
                    f"({args.dtype}, serving defaults, draft {args.draft}), T={args.temperature} top-p={args.top_p} "
                    f"top-k={args.top_k}, {len(prompts)} prompts x {args.max_tokens} tokens",
                    False),
             "", "| prompts | mode | drafted tokens | accepted share | vs greedy | tokens/step |",
             "|---|---|---:|---:|---:|---:|"]
    for kind in ("chat", "code", "all"):
        base = rates["greedy"].get(kind, {}).get("accepted_share", 0.0)
        for mode, by_kind in rates.items():
            r = by_kind.get(kind)
            if r:
                lines.append(f"| {kind} | {mode} | {r['draft_tokens']} | "
                             f"{r['accepted_share']:.3f} | "
                             f"{r['accepted_share'] / base if base else 0:.2f} | "
                             f"{r['tokens_per_step']:.2f} |")
    save_report(name, {"config": vars(args), "prompts": [p.name for p in prompts],
                       "rates": rates}, "\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft spec")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--mtbench", type=int, default=8, help="MT-Bench questions [8]")
    parser.add_argument("--humaneval", type=int, default=8, help="HumanEval problems [8]")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draws", type=int, default=32, help="race draws per position [32]")
    parser.add_argument("--serve", action="store_true", help="through an embedded mesh")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    dtype = models.resolve_dtype(args.dtype)
    settings = Settings(model=args.model, dtype=args.dtype)
    target_path = models.resolve(args.model, settings.cache_dir)
    tokenizer = models.load_tokenizer(target_path)
    prompts = load_prompts(Config(args.model, "", args.dtype, mtbench=args.mtbench,
                                  humaneval=args.humaneval, max_tokens=args.max_tokens), tokenizer)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.serve:
        return serve_report(args, prompts, params)
    greedy = SamplingParams()
    eos = tokenizer.eos_token_id
    target = models.load_model(target_path, dtype)
    with torch.inference_mode():
        texts = {}
        for i, p in enumerate(tqdm(prompts, desc="target continuations", leave=False)):
            sampled = sampled_continuation(target, p.ids, args.max_tokens,
                                           Sampler(params, seed=i), eos)
            texts[p.name] = (sampled, _hf_generate(target, p.ids, args.max_tokens, eos, {}))
        # the continuation's rows only: row j = the logits that sampled out[j]
        target_logits = {p.name: [target(input_ids=torch.tensor([p.ids + out])).logits[
            0, len(p.ids) - 1:len(p.ids) - 1 + len(out)].float() for out in texts[p.name]]
            for p in prompts}
    del target
    gc.collect()
    lm = load_draft_lm(DraftSpec.parse(args.draft), settings, target_path, args.draft, None)
    columns = getattr(lm, "token_ids", None)
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    counts: dict[str, int] = defaultdict(int)
    greedy_counts: dict[str, int] = defaultdict(int)
    with torch.inference_mode():
        for i, p in enumerate(tqdm(prompts, desc="positions", leave=False)):
            kind = "code" if p.category == "code" else "chat"
            for out, logits, rule_params in zip(texts[p.name], target_logits[p.name],
                                                (params, greedy)):
                draft = lm.forward(lm.new_cache(), torch.tensor(p.ids + out)).float()[
                    len(p.ids) - 1:len(p.ids) - 1 + len(out)]
                if columns is not None:  # a draft vocabulary: its columns at their token ids
                    full = torch.full((draft.shape[0], logits.shape[1]), float("-inf"))
                    full[:, columns] = draft
                    draft = full
                for j in range(len(out)):
                    row = j
                    width = logits.shape[1]
                    if rule_params is greedy:
                        top = torch.topk(draft[row, :width], WIDTH).indices.tolist()
                        greedy_counts[kind] += 1
                        sums[kind]["greedy"][0] += top[0] == out[j]
                        sums[kind]["greedy"][1] += out[j] in top
                        continue
                    pt = probabilities(logits[row], params)
                    qt = probabilities(draft[row, :width], params)
                    counts[kind] += 1
                    for rule, (chain, level) in position_rates(
                            pt, qt, args.draws, seed=1000 * i + j).items():
                        sums[kind][rule][0] += chain
                        sums[kind][rule][1] += level
    table = {kind: {rule: [v / (greedy_counts[kind] if rule == "greedy" else counts[kind])
                           for v in sums[kind][rule]] for rule in RULES}
             for kind in sorted(sums)}
    name = f"coupling-{args.model}-{args.dtype}" + (f"-{args.tag}" if args.tag else "")
    report = {"config": vars(args), "prompts": [p.name for p in prompts], "rates": table,
              "positions": dict(counts)}
    lines = [header(f"acceptance rules, target {args.model}, draft {args.draft} ({args.dtype}), "
                    f"T={args.temperature} top-p={args.top_p} top-k={args.top_k}, "
                    f"{len(prompts)} prompts x {args.max_tokens} tokens", False),
             "", "| prompts | rule | chain: first token accepted | 4 candidates: one accepted "
             "| vs greedy (chain) |", "|---|---|---:|---:|---:|"]
    for kind, rates in table.items():
        for rule in RULES:
            chain, level = rates[rule]
            lines.append(f"| {kind} | {rule} | {chain:.3f} | {level:.3f} | "
                         f"{chain / max(rates['greedy'][0], 1e-9):.2f} |")
    save_report(name, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
