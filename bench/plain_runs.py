"""Plain runs A/B (docs/decisions/plain-runs.md): one embedded mesh decoding plainly (depth 0,
no lookup), the router's `speculation.plain_tokens` switched between prompt groups in turn (ABC,
CBA, ...), so the host's drift falls on every value alike; tok/s per value with prefill, c in flight.

    python -m bench.plain_runs --target-runner ggml --values 1 4 8 --concurrency 1
    python -m bench.plain_runs --quick
"""
from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace

from specmesh_services.common.config import PLAIN_DECODING, Settings
from specmesh_services.common.prompts import humaneval_problems, mtbench_questions
from specmesh_services.common.serving import compute_executor
from specmesh_services.launch.embedded import EmbeddedMesh


async def measure(args) -> dict[int, tuple[int, float]]:
    prompts = ([q["turns"][0] for q in mtbench_questions()[:args.mtbench]]
               + [p["prompt"] for p in humaneval_problems()[:args.humaneval]])
    settings = Settings(model=args.model, target_runner=args.target_runner
                        ).with_overrides(**PLAIN_DECODING)
    totals = {v: (0, 0.0) for v in args.values}
    async with EmbeddedMesh.start(settings, compute_executor()) as mesh:
        router = mesh.router
        await mesh.generate(prompt="warm up", max_tokens=4)
        groups = [prompts[i:i + args.concurrency]
                  for i in range(0, len(prompts), args.concurrency)]
        for g, group in enumerate(groups):
            for value in args.values if g % 2 == 0 else args.values[::-1]:
                speculation = router.services.speculation.model_copy(
                    update={"plain_tokens": value})
                router.services = replace(router.services, speculation=speculation)
                start = time.perf_counter()
                out = await asyncio.gather(*(mesh.generate(
                    messages=[{"role": "user", "content": p}], max_tokens=args.max_tokens)
                    for p in group))
                tokens, seconds = totals[value]
                totals[value] = (tokens + sum(len(r.token_ids) for r in out),
                                 seconds + time.perf_counter() - start)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--target-runner", default="auto", choices=["auto", "ggml"])
    parser.add_argument("--values", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--mtbench", type=int, default=16)
    parser.add_argument("--humaneval", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.mtbench, args.humaneval, args.max_tokens = 1, 1, 16
    totals = asyncio.run(measure(args))
    base = totals[args.values[0]][0] / totals[args.values[0]][1]
    for value, (tokens, seconds) in totals.items():
        print(f"{args.model} runner={args.target_runner} c={args.concurrency} plain_tokens="
              f"{value}: {tokens / seconds:.2f} tok/s ({tokens} tokens in {seconds:.1f} s), "
              f"{tokens / seconds / base:.3f}x of {args.values[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
