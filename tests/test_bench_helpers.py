"""Benchmark arithmetic: the oracle ceiling of bench.agreement (drafting exactly the accepted
tokens, priced by the measured draft and verify times) and bench.router's bracketed baseline."""
import pytest

from bench.agreement import oracle_speedup
from bench.router import bracket
from bench.run import MethodResult

VERIFY = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}  # ms of a target forward of n rows


def test_a_draft_that_never_agrees_is_plain_decoding():
    assert oracle_speedup([[False] * 7], depth=3, draft_ms=2.0, verify_ms=VERIFY) == 1.0


def test_runs_are_capped_at_the_depth_and_priced_per_step():
    # 5 agreements, a miss, an agreement, a miss: positions 0-3 in one step (3 drafted, the
    # 4th token the bonus), 4-5 (1 drafted, the miss is the bonus), 6-7 (the same)
    agree = [True] * 5 + [False] + [True, False]
    tokens = 4 + 2 + 2
    ms = (3 * 2.0 + VERIFY[4]) + (1 * 2.0 + VERIFY[2]) + (1 * 2.0 + VERIFY[2])
    assert oracle_speedup([agree], depth=3, draft_ms=2.0, verify_ms=VERIFY) == \
        pytest.approx(tokens * VERIFY[1] / ms)


def test_free_perfect_drafts_reach_the_verify_bound():
    # every token agreed, drafting free: (depth + 1) tokens per forward of depth + 1 rows
    speedup = oracle_speedup([[True] * 8], depth=3, draft_ms=0.0, verify_ms=VERIFY)
    assert speedup == pytest.approx(4 * VERIFY[1] / VERIFY[4])


def test_a_bracketed_baseline_is_the_mean_of_the_plain_runs_around_a_method():
    before = MethodResult("plain", tokens=100, seconds=4.0, outputs=[[1, 2]],
                          seconds_per_prompt=[1.0, 3.0])
    after = MethodResult("plain", tokens=100, seconds=6.0, outputs=[[1, 2]],
                         seconds_per_prompt=[2.0, 4.0])
    base = bracket(before, after)
    assert base.seconds == 5.0 and base.tok_s == 20.0
    assert base.seconds_per_prompt == [1.5, 3.5] and base.outputs == [[1, 2]]
    assert before.seconds == 4.0 and before.seconds_per_prompt == [1.0, 3.0]  # not modified


# bench.alternate: configurations on the command line, the summary against the first one
def test_alternate_configs_parse_names_and_typed_overrides():
    from bench.alternate import parse_config
    assert parse_config("chain") == ("chain", {})
    assert parse_config("tree:speculation.width=2,speculation.tree_size=fixed,"
                        "drafters=[\"layers:8\",\"layers:4\"],speculation.voting=true") == (
        "tree", {"speculation.width": 2, "speculation.tree_size": "fixed",
                 "drafters": ["layers:8", "layers:4"], "speculation.voting": True})


@pytest.mark.parametrize("bad", [":speculation.width=2", "tree:speculation.width"])
def test_alternate_configs_reject_a_missing_name_or_value(bad):
    import argparse
    from bench.alternate import parse_config
    with pytest.raises(argparse.ArgumentTypeError):
        parse_config(bad)


def test_alternate_rejects_settings_that_do_not_exist():
    from bench.alternate import check_keys
    check_keys({"speculation.width": 2, "drafters": ["layers:8"], "dtype": "float32"})
    for bad in ({"speculation.widht": 2}, {"speculaton.width": 2}, {"drafter": []}):
        with pytest.raises(ValueError, match="unknown setting"):
            check_keys(bad)


def test_alternate_summary_is_relative_to_the_first_configuration():
    from bench.alternate import markdown, summary
    a = MethodResult("a", tokens=100, seconds=10.0, target_forwards=50,
                     outputs=[[1, 2], [3]])
    b = MethodResult("b", tokens=100, seconds=8.0, target_forwards=25, outputs=[[1, 2], [4]])
    rows = summary({"a": a, "b": b})
    assert [r["vs_first"] for r in rows] == [1.0, pytest.approx(1.25)]
    assert [r["identical_to_first"] for r in rows] == [2, 1]
    assert rows[1]["mean_accepted_length"] == pytest.approx(4.0)
    text = markdown({"model": "m", "dtype": "bfloat16", "common": {}, "summary": rows,
                     "configs": {"a": {}, "b": {"speculation.width": 2}},
                     "prompts": [{"name": "p", "category": "code",
                                  "tok_s": {"a": 10.0, "b": 12.5}}]})
    assert "| b | speculation.width=2 | 12.50 | 1.250 | 4.00 |" in text


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
