"""The verifier's Prometheus metrics (services/common/metrics.py): step histograms, KV gauges,
early pruning's counts, and the fitted step-cost coefficients, which are computed when scraped
rather than at every step."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from specmesh_services.verifier.cost import VerifyCostModel
from specmesh_services.verifier.engine import StepStats
from specmesh_services.common.metrics import VerifierMetrics


def sample(metrics: VerifierMetrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {})


def test_cost_coefficients_follow_the_fit_at_scrape_time():
    cost = VerifyCostModel(min_samples=4)
    pruner = SimpleNamespace(nodes=0, pruned=0)
    engine = SimpleNamespace(cost=cost, evictions=2, target=SimpleNamespace(pruner=pruner),
                             store=SimpleNamespace(used_blocks=3, block_size=16, capacity=1024),
                             lookup_drafted=5, lookup_accepted=3, run_heads_drafted=16,
                             run_heads_accepted=2, ahead_tokens=24)
    metrics = VerifierMetrics()
    stats = StepStats(rows=9, context=300, segments=2, trees=2, seconds=0.05)
    metrics.observe_step(engine, stats, drafted=7, accepted=4)
    assert sample(metrics, "specmesh_verifier_cost_coefficient", {"feature": "rows"}) == 0.0
    for rows in range(1, 40, 3):  # seconds = 0.02 + 0.001 * rows
        cost.observe(rows, 100 + rows, 1, 0.02 + 0.001 * rows)
    metrics.observe_step(engine, stats, drafted=0, accepted=0)
    fit = cost.fit()
    assert sample(metrics, "specmesh_verifier_cost_coefficient",
                  {"feature": "rows"}) == fit.per_row_s
    assert sample(metrics, "specmesh_verifier_cost_coefficient",
                  {"feature": "intercept"}) == fit.intercept_s
    assert sample(metrics, "specmesh_verifier_kv_used_tokens") == 48
    assert sample(metrics, "specmesh_verifier_lookup_drafted_tokens") == 5
    assert sample(metrics, "specmesh_verifier_lookup_accepted_tokens") == 3
    assert sample(metrics, "specmesh_verifier_run_heads_drafted_tokens") == 16
    assert sample(metrics, "specmesh_verifier_run_heads_accepted_tokens") == 2
    assert sample(metrics, "specmesh_verifier_ahead_tokens") == 24
    assert sample(metrics, "specmesh_verifier_accepted_tokens_total") == 4
    assert b"specmesh_verifier_step_seconds_count 2.0" in generate_latest(metrics.registry)
    pruner.nodes, pruner.pruned = 40, 25  # early pruning's counters, read when scraped
    assert sample(metrics, "specmesh_verifier_prune_judged_nodes") == 40
    assert sample(metrics, "specmesh_verifier_pruned_nodes") == 25
    engine.target.pruner = None  # pruning off
    assert sample(metrics, "specmesh_verifier_pruned_nodes") == 0
