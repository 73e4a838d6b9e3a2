"""The router's per-request loop over in-memory fakes (router_fakes.py): outputs, failing
sources, stop conditions, voting and tree sizing, in milliseconds (no model, no gRPC)."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from router_fakes import Mesh, continuation, running
from specmesh_services.common.config import SpeculationSettings
from specmesh.v1 import common_pb2, router_pb2

PROMPT = [1, 2, 3]


def speculation(**overrides) -> SpeculationSettings:
    """One draft model's 4-token chain, fixed size, unless overridden."""
    return SpeculationSettings(**{"source": "model", "depth": 4, "tree_size": "fixed",
                                  "min_probability": 0.0, **overrides})


async def generate(mesh: Mesh, request_id: str = "r", prompt: list[int] = PROMPT,
                   max_tokens: int = 40, **kw) -> tuple[list[int], str, router_pb2.RouteChunk]:
    """The streamed tokens, the text, and the last chunk (its finish reason and stats)."""
    request = router_pb2.RouteRequest(request_id=request_id, prompt_ids=prompt,
                                      max_tokens=max_tokens, **kw)
    chunks = [chunk async for chunk in mesh.router.generate(request)]
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    return tokens, "".join(chunk.text for chunk in chunks), chunks[-1]


def run(mesh: Mesh, *requests: dict):
    """Generates the requests concurrently through the running mesh."""
    async def main():
        async with running(mesh):
            return await asyncio.gather(*(generate(mesh, **r) for r in requests))
    return asyncio.run(main())


def test_output_is_the_targets_and_every_step_is_recorded():
    mesh = Mesh(speculation())
    [(tokens, text, last)] = run(mesh, {"max_tokens": 40})
    assert tokens == continuation(PROMPT, 40)
    assert text == "".join(f"<{t}>" for t in tokens)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    stats = last.stats
    decisions = list(stats.decisions)
    assert [d.step for d in decisions] == list(range(stats.steps))
    assert decisions[0].budget == 0 and decisions[0].tree_size == 0  # the prefill step
    # the drafter's chains are right for 2 tokens: 3 tokens a step after the prefill
    assert all((d.budget, d.tree_size, d.emitted) == (4, 4, 3) for d in decisions[1:-1])
    assert stats.accepted_tokens == 2 * (stats.steps - 1)
    assert mesh.pool.deleted == ["r"] and mesh.drafter.released == ["r"]
    # prefilled once, with the prompt, while the verifier prefilled it too
    assert [list(p.token_ids) for p in mesh.drafter.prefills] == [PROMPT]


def test_a_failed_draft_runs_the_step_without_a_tree_and_resyncs_the_drafter():
    mesh = Mesh(speculation(), drafter={"fail_drafts": {3}})
    [(tokens, _, last)] = run(mesh, {"max_tokens": 30})
    assert tokens == continuation(PROMPT, 30)
    decisions = list(last.stats.decisions)
    assert decisions[3].budget == 4 and decisions[3].tree_size == 0
    assert decisions[4].tree_size == 4, "the next step drafts again"
    # re-prefilled with the whole context as it was when the call failed
    again = list(mesh.drafter.prefills[1].token_ids)
    assert len(mesh.drafter.prefills) == 2 and len(again) == len(PROMPT) + 1 + 3 * 2
    assert again == PROMPT + tokens[:len(again) - len(PROMPT)]


def test_a_failed_prefill_is_retried_with_the_whole_context():
    mesh = Mesh(speculation(), drafter={"fail_prefills": {1}})
    [(tokens, _, last)] = run(mesh, {"max_tokens": 20})
    assert tokens == continuation(PROMPT, 20)
    assert last.stats.decisions[1].tree_size == 0
    assert list(mesh.drafter.prefills[1].token_ids) == PROMPT + tokens[:1]


def test_a_failed_lookup_resets_the_requests_index():
    mesh = Mesh(speculation(source="datastore", max_nodes=4), datastore={"fail_lookups": {2}})
    [(tokens, _, last)] = run(mesh, {"max_tokens": 30})
    assert tokens == continuation(PROMPT, 30)
    decisions = list(last.stats.decisions)
    assert decisions[2].tree_size == 0 and decisions[3].tree_size == 4
    items = [batch.items[0] for batch in mesh.datastore.batches]
    # the first lookup (step 1) indexes the prompt and the prefill step's token
    assert items[0].reset and list(items[0].new_tokens) == PROMPT + tokens[:1]
    assert not items[1].reset
    # the call after the failure sends the whole context again
    assert items[2].reset and list(items[2].new_tokens) == PROMPT + tokens[:len(
        items[2].new_tokens) - len(PROMPT)]
    assert not items[3].reset and mesh.drafter.prefills == []


def test_stop_tokens_stop_strings_and_max_tokens():
    reference = continuation(PROMPT, 60)
    token = reference[9]
    stop_at = reference.index(token)  # the first time the target says it
    pair = reference[20:22]
    text_stop = f"<{pair[0]}><{pair[1]}>"
    cut = "".join(f"<{t}>" for t in reference).index(text_stop)
    mesh = Mesh(speculation())
    (by_token, token_text, token_last), (by_text, text, text_last), (capped, _, capped_last) = run(
        mesh, {"request_id": "token", "stop_token_ids": [token], "max_tokens": 60},
        {"request_id": "text", "stop": [text_stop], "max_tokens": 60},
        {"request_id": "capped", "max_tokens": 7})
    # a stop token ends the output mid-step, and is not text
    assert by_token == reference[:stop_at + 1]
    assert token_last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert token_text == "".join(f"<{t}>" for t in reference[:stop_at])
    # a stop string: the text ends before it, the tokens with the one that completed it
    assert text == "".join(f"<{t}>" for t in reference)[:cut]
    assert text_last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert by_text == reference[:len(by_text)] and len(by_text) <= 22
    assert capped == reference[:7]
    assert capped_last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert capped_last.stats.completion_tokens == 7


def test_concurrent_requests_share_batched_draft_calls():
    mesh = Mesh(speculation(source="both", max_nodes=8))
    prompts = [PROMPT, [4, 5, 6], [7, 8, 9]]
    results = run(mesh, *({"request_id": f"r{i}", "prompt": p, "max_tokens": 24}
                          for i, p in enumerate(prompts)))
    for prompt, (tokens, _, last) in zip(prompts, results):
        assert tokens == continuation(prompt, 24)
        # the union of the model's chain and the datastore's: the longer right path is taken
        assert {tuple(d.drafters) for d in last.stats.decisions[1:-1]} == {("datastore", "model")}
    assert max(len(batch.items) for batch in mesh.drafter.batches) > 1
    assert max(len(batch.items) for batch in mesh.datastore.batches) > 1


def test_draft_items_ready_together_go_out_in_micro_batches():
    """SPIN's pipeline: requests ready together draft in calls of at most 2 (2 micro-batches
    fixed; 3 at once without), the output unchanged."""
    prompts = [[i, i + 1, i + 2] for i in range(1, 13, 3)]
    requests = [{"request_id": f"r{i}", "prompt": p, "max_tokens": 16}
                for i, p in enumerate(prompts)]
    for router, largest in (({"micro_batches": 2}, 2), ({}, 3)):
        mesh = Mesh(speculation(), router=router)
        results = run(mesh, *requests)
        assert [tokens for tokens, _, _ in results] == [continuation(p, 16) for p in prompts]
        assert max(len(batch.items) for batch in mesh.drafter.batches) == largest, router


def test_a_step_publishes_its_expected_drafting_when_it_plans():
    """Requests planning in the same turn see the drafting the step will wait for (D of the
    planned size: the drafter's prior, 4 levels at 10 ms, then the drafts' measured time, the
    fake's 1 ms), not 0 until the tree is back."""
    mesh = Mesh(speculation(), drafter_costs={"": 0.01})
    published = []
    plan = mesh.router.batch.plan
    mesh.router.batch.plan = lambda rid, nodes, tokens, seconds: (
        published.append((nodes, seconds)), plan(rid, nodes, tokens, seconds))[1]
    (tokens, _, _), = run(mesh, {"max_tokens": 12})
    assert tokens == continuation(PROMPT, 12)
    planned = published[2::2]  # each step: its plan, then its drafted tree (step 0: no tree)
    assert planned[0] == (4, pytest.approx(0.04)), published
    assert len(planned) > 1 and all(p == (4, pytest.approx(0.001)) for p in planned[1:])


def test_the_heuristic_splits_by_the_measured_pass_cost_where_drafting_runs_beside():
    for pipelined, intercept, parts in ((True, 0.0, 4), (True, 0.5, 1), (False, 0.0, 1)):
        router = Mesh(speculation(), pipelined=pipelined).router
        assert router.micro_batches(4) == 1  # nothing measured yet
        for rows in (5, 10, 20):
            router.verify_times.observe(rows, intercept + 0.01 * rows)
        assert router.micro_batches(4) == parts, (pipelined, intercept)


def test_the_selection_charges_a_move_the_drafters_prefill_of_the_whole_context():
    """SPIN eq. 6: LBSS weighs a switch by the destination's measured prefill seconds per token
    times the request's context, prompt and generated tokens. Every ask starts a new slot (a
    scripted clock, one slot per ask), so every step is planned again."""
    mesh = Mesh(speculation(selection="lbss", source="model", slot_s=1.0),
                drafter_names=["a", "b"], drafter_prefill={"a": 0.002, "b": 0.03})
    ticks = itertools.count(1)
    selection = mesh.router.selection
    selection._clock, selection._slot_started = lambda: float(next(ticks)), 0.0
    lbss = selection.lbss
    assert [(d.name, d.switch_cost_per_token_s) for d in lbss.drafters] == [("a", 0.002),
                                                                            ("b", 0.03)]
    seen = []
    assign = lbss.assign
    lbss.assign = lambda ids, contexts, idle=None: (seen.append(dict(contexts)),
                                                    assign(ids, contexts, idle))[1]
    (tokens, _, _), = run(mesh, {"max_tokens": 24})
    assert tokens == continuation(PROMPT, 24)
    contexts = [c["r"] for c in seen]
    assert contexts[0] == len(PROMPT) and contexts[-1] > len(PROMPT)
    assert contexts == sorted(contexts) and contexts[-1] < len(PROMPT) + 24


def test_a_tree_that_would_wait_for_the_drafters_prefill_is_charged_for_it():
    """The draft stage prices the prefill a request still needs on an arm (its context at the
    arm's measured rate), until the drafter holds it."""
    from specmesh_services.router.drafting import DraftStage

    async def check():
        mesh = Mesh(speculation(), drafter_prefill={"": 0.002})
        async with running(mesh):
            stage = DraftStage(mesh.router.services, "r", lambda: PROMPT * 10)
            arm = mesh.router.services.arms.configured
            assert stage.switch_seconds(arm) == pytest.approx(0.002 * 30)
            stage.warm(arm)
            await asyncio.gather(*(s.prefill_task for s in stage.syncs.values()))
            assert stage.switch_seconds(arm) == 0.0
    asyncio.run(check())


def test_voting_verifies_the_majority_path_and_credits_its_drafter():
    names = ["good", "also-good", "bad"]
    mesh = Mesh(speculation(voting=True), drafter_names=names,
                drafter={"correct": {"good": None, "also-good": None, "bad": 0}})
    [(tokens, _, last)] = run(mesh, {"max_tokens": 30})
    assert tokens == continuation(PROMPT, 30)
    decisions = list(last.stats.decisions)
    assert all(list(d.drafters) == ["good"] and d.emitted == 5 for d in decisions[1:-1])
    weights = mesh.router.voter.weights
    assert weights["good"] > 1.0 and weights["also-good"] == weights["bad"] == 1.0


def test_fixed_sizing_drafts_the_configured_tree_every_step():
    mesh = Mesh(speculation(depth=6))
    [(_, _, last)] = run(mesh, {"max_tokens": 30})
    assert {d.budget for d in last.stats.decisions[1:]} == {6}
    assert {item.depth for batch in mesh.drafter.batches for item in batch.items} == {6}


def test_adaptive_sizing_bootstraps_the_default_size_then_a_plain_step():
    mesh = Mesh(speculation(depth=6, tree_size="adaptive"))
    [(tokens, _, last)] = run(mesh, {"max_tokens": 40})
    assert tokens == continuation(PROMPT, 40)
    first, second = last.stats.decisions[1:3]
    assert (first.budget, first.tree_size, first.probe) == (6, 6, True)
    assert (second.budget, second.tree_size, second.probe) == (0, 0, True)
    assert last.stats.plain_steps >= 1


def test_length_sizing_shapes_the_draft_with_its_length():
    mesh = Mesh(speculation(depth=6, tree_size="length"))
    [(tokens, _, last)] = run(mesh, {"max_tokens": 20})
    assert tokens == continuation(PROMPT, 20)
    assert {d.budget for d in last.stats.decisions[1:]} == {4}  # Minions' initial length
    assert {item.depth for batch in mesh.drafter.batches for item in batch.items} == {4}


def test_back_pressure_follows_the_batch_size_the_verifiers_report():
    """By default drafting pauses at as many pending trees as the verifiers that answered
    batch together: none before the first result, then the reported batch size."""
    mesh = Mesh(speculation())
    assert mesh.router.pending_limit() == 0
    run(mesh, {"max_tokens": 8})
    assert mesh.router.pending_limit() == 4
    fixed = Mesh(speculation())
    fixed.router.settings = fixed.router.settings.model_copy(update={"max_pending_trees": 2})
    assert fixed.router.pending_limit() == 2


def test_a_sampled_request_prefills_its_drafter_with_its_sampling_and_seed():
    """Coupled drafting: the drafter is told the request's sampling, its seed (drawn when the
    client gave none) and the target's vocabulary; greedy requests send none."""
    mesh = Mesh(speculation())
    sampled = common_pb2.SamplingParams(temperature=0.8, top_p=0.9)
    run(mesh, {"request_id": "hot", "max_tokens": 8, "sampling": sampled},
        {"request_id": "cold", "max_tokens": 8})
    prefills = {p.request_id: p for p in mesh.drafter.prefills}
    hot = prefills["hot"]
    assert hot.HasField("sampling") and hot.sampling.HasField("seed")
    assert abs(hot.sampling.temperature - 0.8) < 1e-6 and hot.target_vocab_size > 0
    assert not prefills["cold"].HasField("sampling")


def test_prespeculation_hits_when_the_path_is_accepted_and_rolls_back_when_not():
    """Pre-speculation: the next tree is drafted while a step is verified, under "the whole
    path accepted". A drafter always right hits every step after the first drafted one (its
    Draft calls are the ahead ones); one right for 2 of 4 tokens misses every step, is rolled
    back (context_len) and drafts again. The output is the target's either way."""
    right = Mesh(speculation(prespeculate=True), drafter={"correct": {"": None}})
    [(tokens, _, last)] = run(right, {"max_tokens": 40})
    assert tokens == continuation(PROMPT, 40)
    kinds = [d.prespeculation for d in last.stats.decisions]
    assert kinds[:2] == ["", ""] and set(kinds[2:]) == {"hit"}, kinds
    ahead = [item for b in right.drafter.batches for item in b.items
             if len(item.new_tokens) > 1]  # an ahead call commits the whole path
    assert len(ahead) >= len(kinds) - 2
    wrong = Mesh(speculation(prespeculate=True))
    [(tokens, _, last)] = run(wrong, {"max_tokens": 40})
    assert tokens == continuation(PROMPT, 40)
    kinds = [d.prespeculation for d in last.stats.decisions]
    assert set(kinds[2:]) == {"miss"}, kinds
