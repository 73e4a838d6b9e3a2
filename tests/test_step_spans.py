"""The spans that split a served step's time (bench.step_time), from a real embedded mesh: each
request's `router.draft` and `router.verify` under its `router.generate`, the engine step's
timers on every `verifier.verify`, and the bench's timeline of the run adding up to it."""
from __future__ import annotations

import asyncio

import pytest

from bench.step_time import Probe, TimedExecutor, span_recorder, split
from specmesh_services.launch.embedded import EmbeddedMesh

PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def run(base_settings, compute):
    """Two requests in flight, a draft tree every step after the first; (probe, responses)."""
    settings = base_settings.with_overrides(drafters=["layers:8"], **{"speculation.depth": 3})
    probe = Probe(span_recorder(), TimedExecutor(compute))

    async def main():
        async with EmbeddedMesh.start(settings, probe.compute) as mesh:
            await mesh.generate(prompt="warm up", max_tokens=2)
            probe.on_start(mesh)
            return await asyncio.gather(*(mesh.generate(prompt=p, max_tokens=8)
                                          for p in PROMPTS))
    responses = asyncio.run(main())
    yield probe, responses
    probe.spans.shutdown()  # later tests' spans are not kept


def test_each_step_has_its_draft_and_verify_spans_under_the_request(run):
    probe, responses = run
    spans = probe.spans.get_finished_spans()
    for out in responses:
        (request,) = [s for s in spans if s.name == "router.generate"
                      and s.attributes["specmesh.request_id"] == out.request_id]
        children = [s for s in spans if s.parent is not None
                    and s.parent.span_id == request.context.span_id]
        verifies = [s for s in children if s.name == "router.verify"]
        drafts = [s for s in children if s.name == "router.draft"]
        assert len(verifies) == out.stats.steps, "one verify round trip per step"
        assert len(drafts) == out.stats.steps - 1, "a tree drafted every step but the first"
        # each verification step's span: its tree, what was accepted, who drafted it
        outcome = [(s.attributes["specmesh.tree_size"], s.attributes["specmesh.accepted"])
                   for s in sorted(verifies, key=lambda s: s.attributes["specmesh.step"])]
        assert outcome == [(d.tree_size, max(d.emitted - 1, 0)) for d in out.stats.decisions]
        assert all(s.attributes["specmesh.prespeculated"] == "none" for s in verifies)
        assert {tuple(s.attributes["specmesh.sources"]) for s in verifies
                if s.attributes["specmesh.tree_size"]} == {("smollm2-135m:layers=8",)}
        assert all(request.start_time <= s.start_time and s.end_time <= request.end_time
                   for s in children)


def test_verify_spans_carry_their_engine_steps_timers(run):
    probe, _ = run
    verifies = [s for s in probe.spans.get_finished_spans() if s.name == "verifier.verify"
                and s.start_time >= probe.start_ns]
    assert verifies and all("specmesh.verifier_step" in s.attributes for s in verifies)
    steps = {s.attributes["specmesh.verifier_step"]: s.attributes for s in verifies}
    for attrs in steps.values():
        assert attrs["specmesh.forward_seconds"] > 0 and attrs["specmesh.walk_seconds"] > 0
        assert attrs["specmesh.step_rows"] >= 1 and attrs["specmesh.batch_wait_seconds"] >= 0
        assert attrs["specmesh.step_bucket"] == attrs["specmesh.step_kv_chunks"] == 0  # a CPU
    engine_s = sum(a["specmesh.forward_seconds"] + a["specmesh.walk_seconds"]
                   for a in steps.values())
    jobs_s = sum(end - start for kind, start, end in probe.compute.jobs
                 if kind == "verifier-step") / 1e9
    assert engine_s <= jobs_s, "the engine's timers fit in its compute-thread jobs"


def test_the_parts_add_up_to_the_run(run):
    probe, responses = run
    found = split(probe)
    parts = found["parts_s"]
    top = ["forward", "walk", "verifier-other", "drafting", "router", "hops", "batch-wait",
           "other"]
    assert sum(parts[k] for k in top) == pytest.approx(found["wall_s"], rel=1e-6)
    assert 0 < parts["attention"] < parts["forward"] and parts["drafting"] > 0
    assert found["steps"] >= max(out.stats.steps for out in responses)
