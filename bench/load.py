"""Concurrent streaming load on a running gateway, every output checked against its reference.

`concurrency` workers each stream chat prompts in turn (worker i starts at prompt i) until a
deadline or a request count; a request's tokens must equal its prompt's reference (the same
stack's own greedy output, taken one request at a time before the load). Latencies as vLLM's
benchmark_serving measures them: time to first token = request sent -> first chunk with tokens;
inter-token latency = the gap between successive chunks (a chunk carries every token a
verification step accepted, so one gap covers several tokens).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers_report import host
from specmesh import AsyncClient
from specmesh_services.common.prompts import humaneval_problems, mtbench_questions


@dataclass(frozen=True)
class Prompt:
    name: str
    messages: tuple[dict, ...]


@dataclass
class LoadStats:
    requests: int = 0  # finished, with or without error
    errors: list[str] = field(default_factory=list)  # one line per failed request
    mismatched: list[str] = field(default_factory=list)  # prompts whose output differed
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def identical(self) -> int:
        return self.requests - len(self.errors) - len(self.mismatched)

    def summary(self) -> dict:
        return {"requests": self.requests, "errors": len(self.errors),
                "identical": self.identical, "mismatched": len(self.mismatched),
                "tokens": self.tokens, "seconds": round(self.seconds, 1),
                "tok_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
                "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p99_s": percentile(self.ttft_s, 99),
                "itl_p50_s": percentile(self.itl_s, 50), "itl_p99_s": percentile(self.itl_s, 99),
                "first_errors": self.errors[:5]}


def report_head(script: str, argv: list[str] | None, args, model: str, stats: LoadStats
                ) -> dict:
    """What a load benchmark's report starts with: date, host, command, config, load figures."""
    given = argv if argv is not None else sys.argv[1:]
    return {"date": datetime.date.today().isoformat(), "host": host(),
            "command": f"python -m bench.{script} " + " ".join(given),
            "config": {**vars(args), "model": model}, "load": stats.summary()}


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 4)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1], 4)


def chat_prompts(count: int) -> list[Prompt]:
    """MT-Bench first turns and HumanEval problems, alternating, as chat requests."""
    questions, problems = mtbench_questions(), humaneval_problems()
    out = []
    for i in range(count):
        if i % 2 == 0:
            q = questions[(i // 2) % len(questions)]
            out.append(Prompt(f"mtbench-{q['question_id']}",
                              ({"role": "user", "content": q["turns"][0]},)))
        else:
            p = problems[(i // 2) % len(problems)]
            out.append(Prompt(p["task_id"], ({"role": "user", "content": "Complete this Python "
                                              "function:\n" + p["prompt"]},)))
    return out


@contextlib.contextmanager
def running_stack(settings, routers: int, verifiers: int) -> Iterator[tuple[object, str, object]]:
    """The multi-process stack (what `specmesh up` runs) over a private Redis with AOF:
    (the Stack, the gateway's address, the RedisServer)."""
    from specmesh_services.launch.procs import free_port
    from specmesh_services.launch.redis_server import RedisServer
    from specmesh_services.launch.stack import Stack

    with RedisServer(appendonly=True) as redis, tempfile.TemporaryDirectory() as logs:
        stack = Stack(settings.with_overrides(redis_url=redis.url), free_port(), Path(logs),
                      verifiers=verifiers, routers=routers)
        try:
            print(f"starting the stack ({routers} router(s), {verifiers} verifier(s))", flush=True)
            stack.start()
            yield stack, f"127.0.0.1:{stack.gateway_port}", redis
        finally:
            stack.stop()


async def references(address: str, prompts: list[Prompt], max_tokens: int) -> list[list[int]]:
    """Each prompt's output, one request at a time."""
    async with AsyncClient(address, timeout=3600) as client:
        return [list((await client.chat(list(p.messages), max_tokens=max_tokens)).token_ids)
                for p in prompts]


async def run_load(address: str, prompts: list[Prompt], expected: list[list[int]],
                   max_tokens: int, concurrency: int, seconds: float | None = None,
                   requests: int | None = None, timeout_s: float = 1800,
                   until: Callable[[int], bool] | None = None) -> LoadStats:
    """Streams until `seconds` have passed (requests in flight then finish), `requests` have
    been sent, or `until(sent so far)` holds: a load that must outlast some event, whatever
    the host's speed."""
    stats = LoadStats()
    began = time.monotonic()
    sent = 0

    def more() -> bool:
        nonlocal sent
        if seconds is not None and time.monotonic() - began >= seconds:
            return False
        if requests is not None and sent >= requests:
            return False
        if until is not None and until(sent):
            return False
        sent += 1
        return True

    async def worker(client: AsyncClient, index: int) -> None:
        turn = index
        while more():
            prompt, reference = prompts[turn % len(prompts)], expected[turn % len(prompts)]
            turn += concurrency
            tokens: list[int] = []
            start = last = time.monotonic()
            try:
                async for chunk in client.stream_chat(list(prompt.messages),
                                                      max_tokens=max_tokens):
                    now = time.monotonic()
                    if chunk.token_ids:
                        if not tokens:
                            stats.ttft_s.append(now - start)
                        else:
                            stats.itl_s.append(now - last)
                        last = now
                    tokens += chunk.token_ids
            except Exception as err:  # noqa: BLE001 - counted and reported
                stats.errors.append(f"{prompt.name}: {type(err).__name__}: {err}"[:300])
            else:
                if tokens != reference:
                    stats.mismatched.append(prompt.name)
            stats.requests += 1
            stats.tokens += len(tokens)

    async with AsyncClient(address, timeout=timeout_s) as client:
        await asyncio.gather(*(worker(client, i) for i in range(concurrency)))
    stats.seconds = time.monotonic() - began
    return stats
