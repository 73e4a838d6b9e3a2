"""Benchmark arithmetic: bench.router's bracketed baseline, bench.step_time's and
bench.timeline's interval arithmetic, and bench.timeline's command-line settings."""
import argparse

import pytest

from bench.router import bracket
from bench.run import MethodResult


def test_a_bracketed_baseline_is_the_mean_of_the_plain_runs_around_a_method():
    before = MethodResult("plain", tokens=100, seconds=4.0, outputs=[[1, 2]],
                          seconds_per_prompt=[1.0, 3.0])
    after = MethodResult("plain", tokens=100, seconds=6.0, outputs=[[1, 2]],
                         seconds_per_prompt=[2.0, 4.0])
    base = bracket(before, after)
    assert base.seconds == 5.0 and base.tok_s == 20.0
    assert base.seconds_per_prompt == [1.5, 3.5] and base.outputs == [[1, 2]]
    assert before.seconds == 4.0 and before.seconds_per_prompt == [1.0, 3.0]  # not modified


# bench.timeline: --set KEY=VALUE settings
def test_timeline_settings_parse_typed_values():
    from bench.timeline import parse_overrides
    assert parse_overrides([]) == {}
    assert parse_overrides(["speculation.width=2", "speculation.tree_size=fixed",
                            "drafters=[\"layers:8\",\"layers:4\"]",
                            "speculation.voting=true"]) == {
        "speculation.width": 2, "speculation.tree_size": "fixed",
        "drafters": ["layers:8", "layers:4"], "speculation.voting": True}


@pytest.mark.parametrize("bad", ["=2", "speculation.width"])
def test_timeline_settings_reject_a_missing_key_or_value(bad):
    from bench.timeline import parse_overrides
    with pytest.raises(argparse.ArgumentTypeError):
        parse_overrides([bad])


# bench.step_time: the timeline that splits a step's time among its parts
def test_each_instant_goes_to_the_first_active_label_and_the_rest_to_other():
    from bench.step_time import timeline
    s = 1_000_000_000  # ns
    parts = timeline((0, 10 * s), {"compute": [(1 * s, 4 * s)],
                                   "router": [(3 * s, 6 * s), (5 * s, 7 * s)],
                                   "hops": [(0, 2 * s), (8 * s, 12 * s)]})
    assert parts == {"compute": 3.0, "router": 3.0, "hops": 3.0, "other": 1.0}
    assert sum(parts.values()) == 10.0, "the parts add up to the window"


def test_a_request_loop_outside_its_waits_is_the_router():
    from bench.step_time import subtract
    assert subtract((0, 10), [(6, 8), (2, 4), (3, 5)]) == [(0, 2), (5, 6), (8, 10)]
    assert subtract((0, 10), [(0, 10)]) == []
    assert subtract((0, 10), [(-5, 1), (9, 20)]) == [(1, 9)]


# bench.timeline: the verifier's idle time and the drafting the requests wait for
def test_the_verifier_idles_where_none_of_its_steps_runs():
    from bench.timeline import idle_share, union
    steps = [(1, 3), (2, 4), (6, 7), (9, 12)]  # overlapping, and one past the window
    assert union(steps) == [(1, 4), (6, 7), (9, 12)]
    assert idle_share((0, 10), steps) == pytest.approx(1 - (3 + 1 + 1) / 10)
    assert idle_share((0, 10), []) == 1.0


def test_drafting_while_the_request_has_no_tree_out_is_on_the_critical_path():
    from bench.timeline import drafting_shares
    # request a: sequential, draft then its tree's round trip, twice; request b drafts its
    # second step while its first tree is out (a pre-speculation hit) and 1 s after it returns
    drafts = {"a": [(0, 2), (5, 7)], "b": [(0, 1), (3, 6)]}
    in_flight = {"a": [(2, 5), (7, 9)], "b": [(1, 5)]}
    busy = [(3, 5), (8, 9)]  # the verifier's steps
    shares = drafting_shares(drafts, in_flight, busy, (0, 10))
    assert shares["drafting_s"] == 2 + 2 + 1 + 3
    assert shares["critical_share"] == pytest.approx((2 + 2 + 1 + 1) / 8)
    assert shares["hidden_share"] == pytest.approx(2 / 8)  # b's drafting in 3-5


def test_drafting_is_counted_once_per_request_and_inside_the_window():
    from bench.timeline import drafting_shares
    shares = drafting_shares({"a": [(-2, 2), (1, 3)]}, {"a": [(2, 4)]}, [], (0, 10))
    assert shares == {"drafting_s": 3, "critical_share": pytest.approx(2 / 3),
                      "hidden_share": 0.0}
    assert drafting_shares({}, {}, [(0, 1)], (0, 10))["critical_share"] is None


def _span(name, span_id, start, end, parent=None, **attributes):
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext
    return ReadableSpan(name, SpanContext(1, span_id, False),
                        SpanContext(1, parent, False) if parent else None,
                        attributes={f"specmesh.{k}": v for k, v in attributes.items()},
                        start_time=start, end_time=end)


def test_each_request_step_gets_its_draft_queue_and_engine_step():
    from bench.timeline import step_records, summarize
    s = 1_000_000_000
    spans = [_span("router.generate", 1, 0, 10 * s, request_id="r1"),
             _span("router.draft", 2, 1 * s, 2 * s, 1, step=1, prespeculated="hit"),
             _span("router.verify", 3, 2 * s, 5 * s, 1, step=1),
             _span("router.submit", 4, 2 * s, 2 * s + 1000, 3, step=1),
             # deferred once, then verified in engine step 7 (parented on the submit)
             _span("verifier.verify", 5, 2 * s, 3 * s, 4, request_id="r1", step=1,
                   verifier_step=6, deferred=True),
             _span("verifier.verify", 6, 3 * s, 4 * s + s // 2, 4, request_id="r1", step=1,
                   verifier_step=7, forward_seconds=0.5, batch_wait_seconds=0.1, accepted=2),
             # a step without a tree, its verify matched on request id and step
             _span("router.verify", 7, 6 * s, 9 * s, 1, step=2),
             _span("verifier.verify", 8, 7 * s, 8 * s, request_id="r1", step=2,
                   verifier_step=8)]
    jobs = [("verifier-step", 2 * s, 3 * s), ("verifier-step", 3 * s + s // 4, 4 * s),
            ("drafting", 1 * s, 2 * s), ("verifier-step", 7 * s, 8 * s)]
    records, busy = step_records(spans, jobs, (0, 10 * s))
    assert busy == [(2.0, 3.0), (3.25, 4.0), (7.0, 8.0)]
    first, second = records
    assert first["draft"] == [1.0, 2.0] and first["prespeculated"] == "hit"
    assert first["verify"] == [3.25, 4.0] and first["queue_s"] == 1.25
    assert first["verifier_step"] == 7 and first["accepted"] == 2
    assert first["forward_s"] == 0.5 and first["returned"] == 5.0
    assert second["draft"] is None and second["prespeculated"] == "none"
    assert second["verify"] == [7.0, 8.0] and second["submit"] == 6.0
    summary = summarize(records, busy, 10.0)
    assert summary["verifier_idle_share"] == pytest.approx(1 - 2.75 / 10)
    assert summary["critical_share"] == 1.0 and summary["hidden_share"] == 0.0
    assert summary["prespeculated"] == {"hit": 1, "miss": 0}
    assert summary["queue_ms"] == pytest.approx(1125.0)


def test_the_timeline_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.timeline import plot
    records = [{"request": 0, "draft": [0.0, 0.1], "submit": 0.1, "verify": [0.15, 0.3],
                "returned": 0.32, "prespeculated": "none"},
               {"request": 0, "draft": [0.2, 0.3], "submit": 0.32, "verify": [0.35, 0.5],
                "returned": 0.52, "prespeculated": "hit"},
               {"request": 1, "draft": None, "submit": 0.05, "verify": [0.15, 0.3],
                "returned": 0.31, "prespeculated": "miss"},
               {"request": 2, "draft": [3.0, 3.1], "submit": 3.1, "verify": None,
                "returned": 3.3, "prespeculated": "none"}]  # after the window: no lane
    path = tmp_path / "timeline.png"
    assert plot(records, [(0.15, 0.3), (0.35, 0.5)], 1.0, "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# bench.gpu: the device check's counts and the run's ratios
@pytest.mark.parametrize("text, counts", [
    ("....s\n1 failed, 212 passed, 1 skipped, 3 warnings in 80.00s (0:01:20)\n",
     {"failed": 1, "passed": 212, "skipped": 1}),
    ("bringing up nodes...\n165 passed, 54 skipped in 58.48s\n", {"passed": 165, "skipped": 54}),
    ("E   ImportError\n1 error in 0.5s\n", {"error": 1}),
    ("no tests ran in 0.01s\n", {})])
def test_pytest_summary_counts(text, counts):
    from bench.gpu import pytest_counts
    assert pytest_counts(text) == counts


def test_gpu_ratios_divide_tok_s_and_leave_a_missing_side_out():
    from bench.gpu import ratios
    rows = [{"method": "generate", "batch": 1, "tok_s": 40.0},
            {"method": "generate-static", "batch": 1, "tok_s": 320.0},
            {"method": "generate", "batch": 8, "tok_s": 360.0},
            {"method": "mesh-off", "batch": 1, "tok_s": 80.0},
            {"method": "mesh-default", "batch": 1, "tok_s": 160.0},
            {"method": "mesh-default", "batch": 8, "tok_s": 720.0},
            {"method": "up", "batch": 1, "error": "RuntimeError: no redis-server"}]
    assert [x for _, x in ratios(rows, 8)] == [0.5, 0.25, 4.0, 2.0, None]
    assert [x for _, x in ratios(rows[:1], 8)] == [None] * 5


def test_gpu_step_summary_splits_tree_steps_from_plain_runs():
    from bench.gpu import step_summary
    from specmesh.v1 import common_pb2
    decisions = [common_pb2.StepDecision(step=0, emitted=1, seconds=9.0),  # the prefill: left out
                 common_pb2.StepDecision(step=1, tree_size=8, emitted=3, seconds=0.006),
                 common_pb2.StepDecision(step=2, tree_size=16, emitted=1, seconds=0.004),
                 common_pb2.StepDecision(step=3, emitted=20, seconds=0.04)]
    s = step_summary(decisions)
    assert (s["tree_steps"], s["steps"], s["tree_nodes"], s["tree_tokens"]) == (2, 3, 12.0, 2.0)
    assert s["tree_ms"] == pytest.approx(5.0) and s["plain_token_ms"] == pytest.approx(2.0)
    assert step_summary([])["tree_ms"] is None


def test_gpu_variants_are_a_label_and_typed_overrides():
    from bench.gpu import parse
    args = parse(["--variant", "fixed16", "speculation.tree_size=fixed",
                  "speculation.max_nodes=16", "--variant", "lookup-off", "verifier.run_lookup=0"])
    assert args.variant == [("fixed16", {"speculation.tree_size": "fixed",
                                         "speculation.max_nodes": 16}),
                            ("lookup-off", {"verifier.run_lookup": 0})]
    for bad in (["speculation.depth"], ["speculation.nodes=3"], ["speculation.depth=-1"]):
        with pytest.raises(SystemExit):
            parse(["--variant", "bad", *bad])


def test_interleaved_peers_rounds_sum_into_one_row_each():
    from bench.peers import merge_rounds
    from bench.peers_report import _rounds

    def row(engine, tokens, seconds, accepted=None, identical="1/2"):
        return {"engine": engine, "mode": "plain", "batch": 1, "tokens": tokens,
                "seconds": seconds, "tok_s": tokens / seconds, "identical": identical,
                "identical_to_own_plain": "2/2", "accepted_length": accepted}

    rows = merge_rounds([[row("llama.cpp", 100, 1.0), row("specmesh", 100, 2.0, 2.0)],
                         [row("llama.cpp", 300, 2.0), row("specmesh", 100, 1.0, 4.0, "2/2")]])
    llama, mesh = rows
    assert (llama["tokens"], llama["seconds"], llama["tok_s"]) == (400, 3.0, 400 / 3.0)
    assert (mesh["tokens"], mesh["seconds"], mesh["accepted_length"]) == (200, 3.0, 3.0)
    assert (mesh["identical"], mesh["identical_to_own_plain"]) == ("3/4", "4/4")
    assert mesh["round_tok_s"] == [50.0, 100.0]
    failed = merge_rounds([[row("x", 1, 1.0)], [{**row("x", 1, 1.0), "error": "boom"}]])
    assert failed[0]["error"] == "boom"
    lines = _rounds({"rounds": 2, "rows": rows})
    assert lines[-1] == "- specmesh plain batch 1: 0.50x, 0.67x"


def test_peers_refuses_rounds_smaller_than_a_batch():
    """A round of 6 prompts cannot be "batch 8": peers says so instead of mislabeling the row."""
    from bench.peers import parse

    with pytest.raises(SystemExit):
        parse(["--mtbench", "8", "--humaneval", "4", "--rounds", "2", "--batches", "1", "8"])
    assert parse(["--mtbench", "16", "--humaneval", "8", "--rounds", "3"]).rounds == 3
    assert parse(["--quick", "--rounds", "2"]).quick  # a smoke run keeps its 2 prompts
