"""Memory pressure: 32 requests, 8 in flight, through the embedded mesh (router, drafter, pool,
verifier worker) with a verifier KV budget far below what 8 requests need. The verifier must
evict idle requests and re-prefill them when their next tree arrives, or defer a tree until room
frees up, never drop one: every output still equals the target's own greedy `generate`."""
from __future__ import annotations

import asyncio
import time

import torch

from specmesh_services.launch.embedded import EmbeddedMesh
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_REQUESTS = 32
MAX_TOKENS = 16
KV_BUDGET = 640  # rows for all requests together; 8 requests of 47-243 prompt tokens need more


def test_small_kv_budget_evicts_and_outputs_stay_identical(base_settings, hf_target, tokenizer,
                                                          questions, chat_prompt_ids, compute,
                                                          hf_greedy_reference):
    prompts = [chat_prompt_ids(i) for i in range(NUM_REQUESTS)]

    def reference(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            seq = hf_target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=MAX_TOKENS,
                                     pad_token_id=tokenizer.eos_token_id)
        return seq[0, len(ids):].tolist()
    start = time.perf_counter()
    # greedy is prefix-stable: the first questions' 64-token references cut to MAX_TOKENS
    references = [hf_greedy_reference[i][:MAX_TOKENS] if i < len(hf_greedy_reference)
                  else compute.submit(reference, p).result() for i, p in enumerate(prompts)]
    print(f"reference: {time.perf_counter() - start:.1f} s")

    settings = base_settings.with_overrides(
        drafters=["layers:8"], **{"speculation.depth": 2, "verifier.batch_size": 8,
                                  "verifier.kv_budget_tokens": KV_BUDGET})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            gate = asyncio.Semaphore(8)

            async def one(question):
                async with gate:  # the gateway applies the chat template: ids == prompts[i]
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
