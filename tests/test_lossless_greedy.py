"""Lossless, greedy, embedded mode: on the first 20 MT-Bench questions, 64 new tokens,
temperature 0, the mesh's token ids equal the target's own `generate(do_sample=False)`, 20/20,
with real draft trees (width 2, depth 3) and 8 requests in flight, verified in batches. The draft is the target's
full depth, so most of each tree is accepted: long accepted paths, dropped siblings and bonus
tokens every step (partial rejection is covered by test_kv_rollback and the stack test)."""
import asyncio

from specmesh_services.launch.embedded import EmbeddedMesh

NUM_QUESTIONS = 20
MAX_TOKENS = 64


def messages(question):
    return [{"role": "user", "content": question["turns"][0]}]


def assert_target_tokens(responses, references, tokens=None):
    """Every response's token ids equal its reference's (its first `tokens` where given)."""
    mismatches = [i for i, (r, ref) in enumerate(zip(responses, references))
                  if list(r.token_ids) != list(ref[:tokens] if tokens else ref)]
    assert not mismatches, \
        f"{len(mismatches)}/{len(responses)} differ from the target: {mismatches}"


async def generate_all(mesh, questions, concurrency=8):
    gate = asyncio.Semaphore(concurrency)

    async def one(q):
        async with gate:
            return await mesh.generate(messages=messages(q), max_tokens=MAX_TOKENS)
    return await asyncio.gather(*(one(q) for q in questions))


def assert_lossless_with_drafts(settings, questions, references, compute, concurrency=4):
    """The questions through an embedded mesh of `settings`: every output is the target's own
    greedy output, and the drafts were used (drafted tokens, >30% of them accepted)."""
    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            return await generate_all(mesh, questions, concurrency=concurrency)
    responses = asyncio.run(run())
    assert_target_tokens(responses, references)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert drafted > 0 and accepted > 0.3 * drafted, (accepted, drafted)
    return responses


def test_embedded_greedy_equals_target_generate(base_settings, questions, hf_greedy_reference,
                                               compute):
    settings = base_settings.with_overrides(
        drafters=["layers:30"], **{"speculation.depth": 3, "speculation.width": 2})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            return await generate_all(mesh, questions[:NUM_QUESTIONS])
    responses = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert drafted > 0 and accepted > 0, "the draft trees must have been exercised"
    for r in responses:
        assert r.stats.completion_tokens == len(r.token_ids)
        assert r.finish_reason in (1, 2) and r.text
