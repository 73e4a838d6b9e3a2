"""The metric and span attribute names: every metric the services export is listed in
docs/metrics.md and the page lists no other; every span attribute is in docs/tracing.md; the
router's per-source counting follows the accepted path through a tree."""
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from specmesh_services.common.metrics import (RouterMetrics, RpcMetrics, VerifierMetrics,
                                              accepted_nodes)
from specmesh_services.common.tree import TokenTree

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def exported() -> set[str]:
    registry = CollectorRegistry()
    RouterMetrics(registry, "m")
    VerifierMetrics(registry, "m")
    RpcMetrics(registry)
    return {family.name for family in registry.collect()}


def test_docs_list_exactly_the_exported_metrics():
    listed = set(re.findall(r"^\| `([a-z0-9_:]+)` \|", DOC.read_text(), re.M))
    assert listed == exported()


def test_sources_are_counted_along_the_accepted_path():
    # root -> 5 (datastore) -> 6 (draft); root -> 7 (draft) -> 8 (datastore)
    tree = TokenTree((5, 6, 7, 8), (-1, 0, -1, 2), (), (0, 1, 1, 0), ("datastore", "draft"))
    assert accepted_nodes(tree, [7, 8]) == [2, 3]
    assert accepted_nodes(tree, [5, 9]) == [0]
    metrics = RouterMetrics(model="m")
    metrics.observe_step(tree, [7, 8])

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value("specmesh:spec_decode_draft_tokens_by_source_total", source="draft") == 2
    assert value("specmesh:spec_decode_accepted_tokens_by_source_total", source="draft") == 1
    assert value("specmesh:spec_decode_accepted_tokens_by_source_total", source="datastore") == 1
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert value("vllm:spec_decode_num_drafts_total") == 1


def test_every_span_attribute_the_code_sets_is_documented():
    root = DOC.parents[1]
    used = {m for folder in ("services", "gateway") for path in (root / folder).rglob("*.py")
            for m in re.findall(r'"(specmesh\.[a-z_]+)"', path.read_text())}
    table = (root / "docs" / "tracing.md").read_text().split("## Span attributes", 1)[1]
    documented = set(re.findall(r"`(specmesh\.[a-z_]+)`", table.split("## Metrics", 1)[0]))
    assert used == documented
