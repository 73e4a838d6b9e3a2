"""Penalties stay lossless through the tree walk, on the real model (SmolLM2 fp32), embedded mode:
greedy with repetition_penalty=1.3 equals the target's own
`generate(do_sample=False, repetition_penalty=1.3)` token for token, and greedy with a presence or
a frequency penalty (which HF `generate` does not have) equals a loop-based reference decoder over
the target's logits; 3 MT-Bench questions, 28 new tokens each, with real draft trees (width 2,
depth 3). The drafter proposes the target's unpenalized choices, so penalties make the walk reject
drafted tokens and take siblings: the path-extended history must be right for the ids to match."""
import asyncio

import pytest
import torch

from specmesh_services.common import models
from specmesh_services.launch.embedded import EmbeddedMesh

QUESTIONS = [0, 1, 2]
MAX_TOKENS = 28
REPETITION = 1.3
CONFIGS = {  # name: SDK keyword arguments
    "repetition": dict(repetition_penalty=REPETITION),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.5),
}


@pytest.fixture(scope="module")
def eos_ids(target_path, tokenizer):
    return set(models.eos_token_ids(target_path, tokenizer))


def hf_repetition(hf_target, tokenizer, prompt):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        seq = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, repetition_penalty=REPETITION,
                                 pad_token_id=tokenizer.eos_token_id)
    return seq[0, ids.shape[1]:].tolist()


def loop_reference(hf_target, prompt, eos_ids, presence=0.0, frequency=0.0):
    """Greedy decoding of the target, one token per forward (KV cache), the penalties applied
    with plain Python loops over the generated tokens (OpenAI semantics: prompt not counted)."""
    generated: list[int] = []
    with torch.inference_mode():
        out = hf_target(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_TOKENS):
            row = out.logits[0, -1].float().clone()
            for token in set(generated):
                row[token] -= presence + frequency * generated.count(token)
            y = int(row.argmax())
            generated.append(y)
            if y in eos_ids:
                break
            out = hf_target(torch.tensor([[y]]), past_key_values=out.past_key_values,
                            use_cache=True)
    return generated


def test_penalized_greedy_through_the_mesh_equals_the_target(
        base_settings, hf_target, tokenizer, questions, chat_prompt_ids, compute, eos_ids):
    references = {}
    for i in QUESTIONS:
        prompt = chat_prompt_ids(i)
        references["repetition", i] = compute.submit(hf_repetition, hf_target, tokenizer,
                                                     prompt).result()
        references["presence", i] = compute.submit(loop_reference, hf_target, prompt, eos_ids,
                                                   presence=1.5).result()
        references["frequency", i] = compute.submit(loop_reference, hf_target, prompt, eos_ids,
                                                    frequency=0.5).result()
    settings = base_settings.with_overrides(
        drafters=["layers:30"], **{"speculation.depth": 3, "speculation.width": 2})

    async def run():
        gate = asyncio.Semaphore(8)

        async def one(name, i):
            async with gate:
                messages = [{"role": "user", "content": questions[i]["turns"][0]}]
                return await mesh.generate(messages=messages, max_tokens=MAX_TOKENS,
                                           **CONFIGS[name])
        async with EmbeddedMesh.start(settings, compute) as mesh:
            keys = list(references)
            return dict(zip(keys, await asyncio.gather(*(one(*k) for k in keys))))
    responses = asyncio.run(run())

    mismatches = [k for k, r in responses.items() if list(r.token_ids) != references[k]]
    assert not mismatches, f"{len(mismatches)}/{len(responses)} differ from the target: {mismatches}"
    plain = {i: compute.submit(loop_reference, hf_target, chat_prompt_ids(i), eos_ids).result()
             for i in QUESTIONS}
    for name in CONFIGS:  # the penalties changed the output (else the test proves nothing)
        assert any(references[name, i] != plain[i] for i in QUESTIONS), name
    drafted = sum(r.stats.draft_tokens for r in responses.values())
    accepted = sum(r.stats.accepted_tokens for r in responses.values())
    assert accepted > 0 and drafted > accepted, "trees must have been accepted and rejected"
