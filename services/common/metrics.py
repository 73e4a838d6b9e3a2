"""Prometheus metrics of every service: the names, labels and help texts are defined here only
(docs/metrics.md lists them; the Grafana dashboard's queries are checked against them).

Speculation and request metrics carry vLLM's names (`vllm:spec_decode_*`,
`vllm:time_to_first_token_seconds`, ...) and its `model_name` label, so dashboards built for
vLLM chart specmesh unchanged; what vLLM has no name for is `specmesh:*`. Each process serves
one registry (`process_registry`) on `metrics_port`; the gateway also on its HTTP port
(`/metrics`). An embedded mesh gives its roles a registry of their own.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specmesh_services.common.tree import TokenTree

if TYPE_CHECKING:
    from specmesh_services.verifier.engine import StepStats, VerifierEngine

LATENCY_BUCKETS = (.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56, 5.12, 10.24,
                   20.48, 40.96, 81.92)
TOKEN_LATENCY_BUCKETS = (.005, .01, .02, .04, .06, .08, .1, .15, .2, .3, .4, .6, .8, 1.0, 2.0, 5.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_POSITION = 16  # accepted tokens per position are counted for the first 16 positions

_registry: CollectorRegistry | None = None


def process_registry() -> CollectorRegistry:
    """The registry this process serves (created on first use)."""
    global _registry
    if _registry is None:
        _registry = CollectorRegistry()
    return _registry


_rpc: dict[int, "RpcMetrics"] = {}


def rpc_metrics(registry: CollectorRegistry | None = None) -> "RpcMetrics":
    """The RPC timing interceptor of a registry (the process's by default), made once."""
    registry = registry if registry is not None else process_registry()
    if id(registry) not in _rpc:
        _rpc[id(registry)] = RpcMetrics(registry)
    return _rpc[id(registry)]


def serve(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serves `registry` at http://host:port/metrics in a thread; returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


class RouterMetrics:
    """The router's view: every request's steps, its latency and the speculation outcome."""

    def __init__(self, registry: CollectorRegistry | None = None, model: str = "") -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        m = ["model_name"]
        self.model = model
        self.drafts = Counter("vllm:spec_decode_num_drafts", "verification steps that verified "
                              "a draft tree", m, registry=r).labels(model)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens (tree "
                                    "nodes) verified", m, registry=r).labels(model)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens "
                                       "the target accepted", m, registry=r).labels(model)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "accepted draft tokens by depth in the tree (0 = first)",
                                        m + ["position"], registry=r)
        self.source_drafted = Counter("specmesh:spec_decode_draft_tokens_by_source", "draft "
                                      "tokens verified, by the source that proposed them",
                                      m + ["source"], registry=r)
        self.source_accepted = Counter("specmesh:spec_decode_accepted_tokens_by_source",
                                       "accepted draft tokens, by the source that proposed "
                                       "them", m + ["source"], registry=r)
        self.plain_steps = Counter("specmesh:spec_decode_num_plain_steps", "steps after the "
                                   "prefill that verified no tree (speculation did not pay)",
                                   m, registry=r).labels(model)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of finished requests",
                                     m, registry=r).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", m,
                                         registry=r).labels(model)
        self.finished = Counter("vllm:request_success", "finished requests by why they ended",
                                m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "request arrival at the "
                              "router to its first token", m, buckets=LATENCY_BUCKETS,
                              registry=r).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "time between two streamed "
                             "chunks, per token of the later one", m,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "request arrival at the router "
                             "to its end", m, buckets=LATENCY_BUCKETS, registry=r).labels(model)
        self.running = Gauge("vllm:num_requests_running", "requests being generated", m,
                             registry=r).labels(model)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting for a slot "
                             "(admission) or, drafting, for room in the pool (back-pressure)",
                             m, registry=r).labels(model)

    def observe_step(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """One verified step of a request: its tree and the draft tokens the target kept."""
        if not len(tree):
            return
        self.drafts.inc()
        self.draft_tokens.inc(len(tree))
        self.accepted_tokens.inc(len(accepted))
        for position in range(min(len(accepted), MAX_POSITION)):
            self.accepted_per_pos.labels(self.model, str(position)).inc()
        names = tree.source_names
        if tree.sources:
            for source in tree.sources:
                self.source_drafted.labels(self.model, names[source]).inc()
            for node in accepted_nodes(tree, accepted):
                self.source_accepted.labels(self.model, names[tree.sources[node]]).inc()

    def observe_plain(self) -> None:
        self.plain_steps.inc()

    def observe_chunk(self, tokens: int, since_last: float | None) -> None:
        """A streamed chunk of `tokens` tokens, `since_last` seconds after the one before."""
        self.generation_tokens.inc(tokens)
        if tokens and since_last is not None:
            per_token = since_last / tokens
            for _ in range(tokens):
                self.itl.observe(per_token)

    def observe_finished(self, prompt_tokens: int, ttft_s: float, total_s: float,
                         reason: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(total_s)
        self.finished.labels(self.model, reason).inc()

    def track(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """The gauges read when scraped."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)


def accepted_nodes(tree: TokenTree, accepted: Sequence[int]) -> list[int]:
    """The tree's nodes along the accepted tokens, from the root down."""
    nodes, parent = [], -1
    for token in accepted:
        node = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))
                     if t == token and p == parent), None)
        if node is None:
            break
        nodes.append(node)
        parent = node
    return nodes


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Every RPC a service answers, timed by service, method and status code
    (`specmesh:rpc_server_seconds`): the drafter's and datastore's call latency among them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram("specmesh:rpc_server_seconds", "gRPC calls served, from "
                                 "arrival to the last response", ["service", "method", "code"],
                                 buckets=LATENCY_BUCKETS, registry=registry)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        service, _, method = details.method.lstrip("/").rpartition("/")
        timer = self.seconds

        def done(started: float, context) -> None:
            code = context.code() if callable(getattr(context, "code", None)) else None
            name = code.name if isinstance(code, grpc.StatusCode) else "OK"
            timer.labels(service, method, name).observe(time.perf_counter() - started)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                started = time.perf_counter()
                try:
                    return await inner(request, context)
                finally:
                    done(started, context)
            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            started = time.perf_counter()
            try:
                async for item in inner_stream(request, context):
                    yield item
            finally:
                done(started, context)
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)


class VerifierMetrics:
    """One verifier: step cost and shape (its batch), acceptance, KV memory, the cost fit, and
    the pool as it sees it (pending and reclaimed entries). `observe_step` after every step."""

    def __init__(self, registry: CollectorRegistry | None = None, model: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._cost_of: VerifierEngine | None = None
        r = self.registry
        self.step_seconds = Histogram("specmesh_verifier_step_seconds",
                                      "wall time of one batched verification step", registry=r,
                                      buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56))
        self.step_rows = Histogram("specmesh_verifier_step_rows",
                                   "new rows (tree nodes, roots, prefill) in one forward pass",
                                   buckets=ROW_BUCKETS, registry=r)
        self.step_trees = Histogram("specmesh_verifier_step_trees", "trees verified per step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.drafted = Counter("specmesh_verifier_drafted_tokens", "tree nodes verified",
                               registry=r)
        self.accepted = Counter("specmesh_verifier_accepted_tokens",
                                "drafted tokens the target accepted", registry=r)
        self.kv_used = Gauge("specmesh_verifier_kv_used_tokens", "KV rows allocated", registry=r)
        self.kv_capacity = Gauge("specmesh_verifier_kv_capacity_tokens", "KV budget (rows)",
                                 registry=r)
        self.evictions = Gauge("specmesh_verifier_evictions", "requests evicted since start",
                               registry=r)
        self.lookup_drafted = Gauge("specmesh_verifier_lookup_drafted_tokens", "tokens prompt "
                                    "lookup drafted in plain runs and the verifier verified, "
                                    "since start", registry=r)
        self.lookup_accepted = Gauge("specmesh_verifier_lookup_accepted_tokens", "of those, "
                                     "tokens the target accepted, since start", registry=r)
        self.run_heads_drafted = Gauge("specmesh_verifier_run_heads_drafted_tokens", "tree "
                                       "nodes the served heads drafted in plain runs and the "
                                       "verifier verified, since start", registry=r)
        self.run_heads_accepted = Gauge("specmesh_verifier_run_heads_accepted_tokens", "of "
                                        "those, tokens the target accepted, since start",
                                        registry=r)
        self.ahead_tokens = Gauge("specmesh_verifier_ahead_tokens", "tokens plain runs "
                                  "decoded ahead, several steps a host sync (verifier."
                                  "run_ahead), since start", registry=r)
        self.judged = Gauge("specmesh_verifier_prune_judged_nodes", "tree nodes the early "
                            "pruning head judged since start", registry=r)
        self.pruned = Gauge("specmesh_verifier_pruned_nodes", "tree nodes early pruning removed "
                            "after its layer since start (ProPD)", registry=r)
        self.cost = Gauge("specmesh_verifier_cost_coefficient",
                          "fitted step cost: seconds = sum(coefficient * feature)", ["feature"],
                          registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "share of the KV budget allocated "
                              "(0 to 1)", ["model_name"], registry=r).labels(model)
        self.pool_pending = Gauge("specmesh:pool_pending_entries", "trees in the pool not yet "
                                  "acknowledged (queued or in verification)", registry=r)
        self.reclaimed = Counter("specmesh:pool_reclaimed_entries", "trees this verifier "
                                 "re-claimed after another consumer held them too long (a "
                                 "verifier died or hung)", registry=r)
        self.dead_lettered = Counter("specmesh:pool_dead_lettered_entries", "trees this "
                                     "verifier gave up on after max_deliveries deliveries "
                                     "(moved to the dead-letter stream)", registry=r)

    def observe_step(self, engine: VerifierEngine, stats: StepStats, drafted: int,
                     accepted: int) -> None:
        self.step_seconds.observe(stats.seconds)
        self.step_rows.observe(stats.rows)
        self.step_trees.observe(stats.trees)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        store = engine.store
        self.kv_used.set(store.used_blocks * store.block_size)
        self.kv_capacity.set(store.capacity)
        self.kv_usage.set(store.used_blocks * store.block_size / max(store.capacity, 1))
        self.evictions.set(engine.evictions)
        self.lookup_drafted.set(engine.lookup_drafted)
        self.lookup_accepted.set(engine.lookup_accepted)
        self.run_heads_drafted.set(engine.run_heads_drafted)
        self.run_heads_accepted.set(engine.run_heads_accepted)
        self.ahead_tokens.set(engine.ahead_tokens)
        if self._cost_of is not engine:
            self._bind_cost(engine)

    def _bind_cost(self, engine: VerifierEngine) -> None:
        """The cost coefficients are computed when scraped, not at every step: the fit is a
        regression over up to a thousand steps (~1 ms), and at every step it took a quarter of
        the event loop's busy time, on the cores the next forward pass runs on."""
        self._cost_of = engine
        self.judged.set_function(lambda: getattr(engine.target.pruner, "nodes", 0))
        self.pruned.set_function(lambda: getattr(engine.target.pruner, "pruned", 0))
        for feature, attr in (("intercept", "intercept_s"), ("rows", "per_row_s"),
                              ("context", "per_context_s"), ("segments", "per_segment_s")):
            self.cost.labels(feature).set_function(
                lambda attr=attr: getattr(engine.cost.fit(), attr, 0.0))
