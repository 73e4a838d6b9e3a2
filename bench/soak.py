"""Soak: many concurrent streams for minutes through the multi-process stack, every output checked,
each process's RSS sampled; TTFT and inter-token latency p50/p99 (docs/benchmarks/scripts.md).

    python -m bench.soak                                   # 64 streams x 5 min, SmolLM2
    python -m bench.soak --concurrency 8 --seconds 60 --routers 2 --verifiers 2 --tag small
Writes bench/results/soak-<tag>.json and .md.
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

import psutil

from bench.load import chat_prompts, references, report_head, run_load, running_stack
from bench.run import save_report
from specmesh_services.common.config import Settings

MB = 1024 * 1024


class RssSampler(threading.Thread):
    """Samples every `every_s` the RSS (MB) of each named process until stopped."""

    def __init__(self, processes: dict[str, int], every_s: float) -> None:
        super().__init__(daemon=True)
        self.processes = {name: psutil.Process(pid) for name, pid in processes.items()}
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._halt = threading.Event()
        self.began = time.monotonic()

    def sample(self) -> None:
        now = time.monotonic() - self.began
        rss = {}
        for name, process in self.processes.items():
            try:
                rss[name] = round(process.memory_info().rss / MB, 1)
            except psutil.Error:
                rss[name] = None
        self.samples.append((round(now, 1), rss))

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()

    def table(self, warm_s: float) -> list[dict]:
        """Per process: RSS at the start, after the warm-up (the first sample at or after
        `warm_s`), at the end, and the growth after the warm-up."""
        start, end = self.samples[0][1], self.samples[-1][1]
        warm = next((s for t, s in self.samples if t >= warm_s), self.samples[-1][1])
        rows = []
        for name in self.processes:
            row = {"process": name, "start_mb": start[name], "warm_mb": warm[name],
                   "end_mb": end[name]}
            if warm[name] and end[name]:
                row["growth_mb"] = round(end[name] - warm[name], 1)
                row["growth_pct"] = round(100 * (end[name] - warm[name]) / warm[name], 1)
            rows.append(row)
        return rows


def markdown(report: dict) -> str:
    s, c, h = report["load"], report["config"], report["host"]
    lines = [f"### Soak: {c['concurrency']} streams x {c['seconds']:.0f} s, {c['model']} "
             f"({c['dtype']}), {c['routers']} router(s), {c['verifiers']} verifier(s)", "",
             f"Host: {h.get('cpu')}, {h.get('cpus')} CPUs, {' '.join(h.get('flags', []))}; "
             f"{report['date']}; `{report['command']}`", "",
             "| requests | errors | identical outputs | tok/s | TTFT p50 | TTFT p99 | ITL p50 | "
             "ITL p99 |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {s['errors']} | {s['identical']} / {s['requests']} | "
             f"{s['tok_s']} | {_s(s['ttft_p50_s'])} | {_s(s['ttft_p99_s'])} | "
             f"{_s(s['itl_p50_s'])} | {_s(s['itl_p99_s'])} |", "",
             f"RSS (MB): at the start of the load, after {c['warm_s']:.0f} s of warm-up, at "
             f"the end ({len(report['rss_samples'])} samples, every {c['rss_every_s']:.0f} s)", "",
             "| process | start | warm | end | growth after warm-up |", "|---|---:|---:|---:|---:|"]
    for r in report["rss"]:
        growth = (f"{r['growth_mb']:+.1f} ({r['growth_pct']:+.1f}%)" if "growth_mb" in r
                  else "-")
        lines.append(f"| {r['process']} | {r['start_mb']} | {r['warm_mb']} | {r['end_mb']} | "
                     f"{growth} |")
    lines += ["", "TTFT: request sent -> first chunk with tokens; ITL: gap between successive "
              "chunks (a chunk holds every token one verification step accepted), as vLLM's "
              "benchmark_serving measures them. Identical: the output equals the stack's own "
              "for the prompt sent alone."]
    if s["first_errors"]:
        lines += ["", "First errors:", *[f"- {e}" for e in s["first_errors"]]]
    return "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=Settings().model)
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight [64]")
    p.add_argument("--seconds", type=float, default=300.0, help="how long new requests start [300]")
    p.add_argument("--warm-s", type=float, default=60.0,
                   help="RSS growth is measured from this far into the load [60]")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts, sent in turn [16]")
    p.add_argument("--routers", type=int, default=1)
    p.add_argument("--verifiers", type=int, default=1)
    p.add_argument("--rss-every-s", type=float, default=5.0)
    p.add_argument("--tag", default="default")
    args = p.parse_args(argv)

    settings = Settings(model=args.model, dtype=args.dtype)
    prompts = chat_prompts(args.prompts)
    with running_stack(settings, args.routers, args.verifiers) as (stack, address, redis):
        print(f"references: {len(prompts)} prompts, one at a time", flush=True)
        expected = asyncio.run(references(address, prompts, args.max_tokens))
        processes = {c.name: c.process.pid for c in stack.children}
        processes["redis"] = redis.pid
        sampler = RssSampler(processes, args.rss_every_s)
        sampler.sample()
        sampler.start()
        print(f"load: {args.concurrency} streams for {args.seconds:.0f} s", flush=True)
        stats = asyncio.run(run_load(address, prompts, expected, args.max_tokens,
                                     args.concurrency, seconds=args.seconds))
        sampler.stop()
    report = {**report_head("soak", argv, args, settings.model, stats),
              "rss": sampler.table(args.warm_s), "rss_samples": sampler.samples}
    save_report(f"soak-{args.tag}", report, markdown(report))
    return 0 if not stats.errors and not stats.mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
