"""Chaos: concurrent streams through a stack of replicas while a random service is SIGKILLed
every few seconds and started again on its ports; every output must equal the stack's own
undisturbed output for its prompt, token for token (docs/benchmarks/scripts.md).

    python -m bench.chaos                                  # 16 streams, a kill every 10 s, 5 min
    python -m bench.chaos --concurrency 4 --seconds 60 --kill-every-s 6 --tag small
Writes bench/results/chaos-<tag>.json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

from bench.load import chat_prompts, references, report_head, run_load, running_stack
from bench.run import save_report

VICTIMS = ("verifier", "router", "drafter", "datastore")
T = TypeVar("T")


class Chaos:
    """Kills a random live process of the `roles` every `every_s` and restarts it; with
    `in_turn`, a process of each role in turn (every role gets killed in a short run); with
    `limit`, no more than that many kills."""

    def __init__(self, stack, every_s: float, seed: int = 0, roles=VICTIMS,
                 in_turn: bool = False, limit: int | None = None) -> None:
        self.stack, self.every_s, self.roles, self.in_turn = stack, every_s, roles, in_turn
        self.limit = limit
        self.rng = random.Random(seed)
        self.kills: list[tuple[float, str, float]] = []  # (at s, name, seconds until it served)

    def during(self, work: Callable[[], T]) -> T:
        """Runs `work` in a thread of its own and kills meanwhile, from the calling thread,
        until it returns; returns its result. The restarts happen in the calling thread because
        a child dies with the thread that started it (the parent-death signal follows the
        thread), and the caller outlives the run."""
        began = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(work)
            while not wait([future], timeout=self.every_s).done:
                if self.limit is not None and len(self.kills) >= self.limit:
                    continue
                roles = ((self.roles[len(self.kills) % len(self.roles)],) if self.in_turn
                         else self.roles)
                live = [c for c in self.stack.children
                        if c.role in roles and c.process.poll() is None]
                victim = self.rng.choice(live)
                at = time.monotonic()
                victim.process.kill()
                victim.process.wait()
                self.stack.restart(victim)
                self.kills.append((round(at - began, 1), victim.name,
                                   round(time.monotonic() - at, 1)))
            return future.result()

    def finished(self) -> bool:
        """Whether `limit` kills are done and the last one's process serves again."""
        return self.limit is not None and len(self.kills) >= self.limit


def markdown(report: dict) -> str:
    s, c, h = report["load"], report["config"], report["host"]
    kills = report["kills"]
    by_role: dict[str, int] = {}
    for _, name, _ in kills:
        role = name.split("-")[0]
        by_role[role] = by_role.get(role, 0) + 1
    lines = [f"### Chaos: {c['concurrency']} streams x {c['seconds']:.0f} s, a kill every "
             f"{c['kill_every_s']:.0f} s; {c['model']} ({c['dtype']}), {c['routers']} routers, "
             f"{c['verifiers']} verifiers", "",
             f"Host: {h.get('cpu')}, {h.get('cpus')} CPUs, {' '.join(h.get('flags', []))}; "
             f"{report['date']}; `{report['command']}`", "",
             "| requests | kills | errors | identical outputs | tok/s | TTFT p99 | ITL p99 |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {len(kills)} ({', '.join(f'{n} {r}' for r, n in sorted(by_role.items()))}) "
             f"| {s['errors']} | {s['identical']} / {s['requests']} | {s['tok_s']} | "
             f"{s['ttft_p99_s']} s | {s['itl_p99_s']} s |", "",
             "Kills (at s, process, s until it served again): "
             + ", ".join(f"{at} {name} {back}" for at, name, back in kills)]
    if s["first_errors"]:
        lines += ["", "First errors:", *[f"- {e}" for e in s["first_errors"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from specmesh_services.common.config import Settings

    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=Settings().model)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--kill-every-s", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--verifiers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="default")
    args = p.parse_args(argv)

    # the model drafter and the datastore both draft, so both can be killed
    settings = Settings(model=args.model, dtype=args.dtype,
                        speculation={"source": "both"}, verifier={"claim_idle_s": 5.0})
    prompts = chat_prompts(args.prompts)
    with running_stack(settings, args.routers, args.verifiers) as (stack, address, _):
        print(f"references: {len(prompts)} prompts, one at a time", flush=True)
        expected = asyncio.run(references(address, prompts, args.max_tokens))
        chaos = Chaos(stack, args.kill_every_s, args.seed)
        print(f"load: {args.concurrency} streams for {args.seconds:.0f} s, a kill every "
              f"{args.kill_every_s:.0f} s", flush=True)
        stats = chaos.during(lambda: asyncio.run(run_load(
            address, prompts, expected, args.max_tokens, args.concurrency,
            seconds=args.seconds)))
    report = {**report_head("chaos", argv, args, settings.model, stats), "kills": chaos.kills}
    save_report(f"chaos-{args.tag}", report, markdown(report))
    return 0 if not stats.errors and not stats.mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
