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
