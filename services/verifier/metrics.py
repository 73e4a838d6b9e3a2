"""Prometheus metrics of one verifier: step cost and shape, acceptance, KV memory, the cost fit.

A registry per verifier (no module-level globals); `serve(port)` exposes it over HTTP when
`verifier.metrics_port` is set. The worker calls `observe_step` after every batched step.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specmesh_services.verifier.engine import StepStats, VerifierEngine

_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._cost_of: VerifierEngine | None = None
        r = self.registry
        self.step_seconds = Histogram("specmesh_verifier_step_seconds",
                                      "wall time of one batched verification step", registry=r,
                                      buckets=(.005, .01, .02, .04, .08, .16, .32, .64, 1.28, 2.56))
        self.step_rows = Histogram("specmesh_verifier_step_rows",
                                   "new rows (tree nodes, roots, prefill) in one forward pass",
                                   buckets=_ROWS, registry=r)
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
        self.judged = Gauge("specmesh_verifier_prune_judged_nodes", "tree nodes the early "
                            "pruning head judged since start", registry=r)
        self.pruned = Gauge("specmesh_verifier_pruned_nodes", "tree nodes early pruning removed "
                            "after its layer since start (ProPD)", registry=r)
        self.cost = Gauge("specmesh_verifier_cost_coefficient",
                          "fitted step cost: seconds = sum(coefficient * feature)", ["feature"],
                          registry=r)

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
        self.evictions.set(engine.evictions)
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

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
