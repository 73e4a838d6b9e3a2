"""The target's two forwards side by side: the lean decoder loop and transformers' forward
(`target_runner`), the same weights, KV store and attention backend, one verify step of one
request (a context of L tokens plus a chain of n drafted tokens), alternated in one process.

`--cpu-time` reports one thread's CPU time (`time.thread_time`, torch on 1 thread): robust when
the machine is shared; the default is wall time on `--threads` threads.

    python -m bench.target_forward                       # SmolLM2-135M as served (native)
    python -m bench.target_forward --model qwen2.5-coder-1.5b --cpu-time
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specmesh_services.common.config import Settings
from specmesh_services.common.tree import TokenTree
from specmesh.v1 import common_pb2, pool_pb2

RUNNERS = ("lean", "transformers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--target-weights", choices=("auto", "float", "native"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--context", type=int, default=256, help="context tokens L [256]")
    parser.add_argument("--rows", default="1,4,8,16", help="root + drafted tokens [1,4,8,16]")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true", help="one thread's CPU time")
    args = parser.parse_args(argv)
    from specmesh_services.verifier.server import build_engine, load_target

    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    engines = {}
    for runner in RUNNERS:
        settings = Settings(model=args.model, dtype=args.dtype, target_runner=runner,
                            target_weights=args.target_weights)
        engines[runner] = build_engine(load_target(settings), settings, runner)
    vocab = next(iter(engines.values())).lm.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    state = pool_pb2.RequestState(request_id="r", prompt_ids=prompt,
                                  sampling=common_pb2.SamplingParams())

    def step(engine, rows: int) -> float:
        engine.load(state, [])  # keeps the prompt's KV: the step computes root + chain
        tree = TokenTree.chain(torch.randint(0, vocab, (rows - 1,), generator=gen).tolist())
        start = clock()
        engine.step([("r", tree)])
        return clock() - start

    for engine in engines.values():
        step(engine, 1)  # prefill
    print(f"{args.model}: ms per verify step, context {args.context}, "
          f"{'CPU time of 1 thread' if args.cpu_time else f'wall, {args.threads} threads'}")
    print("| rows | " + " | ".join(RUNNERS) + " | lean / transformers |\n|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {r: [] for r in RUNNERS}
        for _ in range(args.reps + 1):  # the first of each is a warm-up
            for runner, engine in engines.items():
                times[runner].append(step(engine, rows))
        ms = {r: 1e3 * statistics.median(t[1:]) for r, t in times.items()}
        print(f"| {rows} | " + " | ".join(f"{ms[r]:.1f}" for r in RUNNERS)
              + f" | {ms['lean'] / ms['transformers']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
