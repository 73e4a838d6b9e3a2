"""Memory pressure: 20 requests, 8 in flight, through the embedded mesh (router, drafter, pool,
verifier worker) with a verifier KV budget far below what 8 requests need. The verifier must
evict idle requests and re-prefill them when their next tree arrives, or defer a tree until room
frees up, never drop one: every output still equals the target's own greedy `generate`."""
from __future__ import annotations

import asyncio
import time

from specmesh_services.launch.embedded import EmbeddedMesh
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_REQUESTS = 20  # those the shared references cover; the budget below still forces evictions
MAX_TOKENS = 16
KV_BUDGET = 512  # rows for all requests together; 8 requests of 47-243 prompt tokens need more


def test_small_kv_budget_evicts_and_outputs_stay_identical(base_settings, questions, compute,
                                                          hf_greedy_reference):
    # greedy is prefix-stable: the questions' 64-token references cut to MAX_TOKENS
    references = [ref[:MAX_TOKENS] for ref in hf_greedy_reference[:NUM_REQUESTS]]
    assert len(references) == NUM_REQUESTS

    settings = base_settings.with_overrides(
        drafters=["layers:8"], **{"speculation.depth": 2, "verifier.batch_size": 8,
                                  "verifier.kv_budget_tokens": KV_BUDGET})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            gate = asyncio.Semaphore(8)

            async def one(question):
                async with gate:  # the chat template applied, as for the references' prompts
                    return await mesh.generate(
                        messages=[{"role": "user", "content": question["turns"][0]}],
                        max_tokens=MAX_TOKENS)
            start = time.perf_counter()
            responses = await asyncio.gather(*(one(q) for q in questions[:NUM_REQUESTS]))
            print(f"mesh: {time.perf_counter() - start:.1f} s")
            for _ in range(50):  # the release feed reaches the verifier asynchronously
                if not mesh.worker.engine.requests:
                    break
                await asyncio.sleep(0.1)
            return responses, mesh.worker.engine
    responses, engine = asyncio.run(run())
    print(f"evictions: {engine.evictions}, steps: {engine.steps}, prefill rows: "
          f"{engine.prefill_rows}")
    assert engine.evictions > 0, "the budget should have forced evictions"
    assert_target_tokens(responses, references)
    assert engine.store.used_blocks == 0 and not engine.requests, "all KV released at the end"
