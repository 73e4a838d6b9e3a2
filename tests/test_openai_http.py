"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client and plain
HTTP: completions and chat, whole and streamed, greedy output equal to the gRPC API's, usage and
per-request speculation metrics that agree with the gRPC statistics, and OpenAI-shaped errors
with their 4xx codes while the server keeps serving.

One embedded mesh (SmolLM2-135M, a 4-layer truncated draft) serves the gRPC gateway and the HTTP
app, both over the same GatewayServicer, on its own event loop in a thread."""
import json

import httpx
import openai
import pytest

from specmesh import Client
from threaded import served_mesh

PROMPT = "The capital of France is"
QUESTION = "Name three colours."
MAX_TOKENS = 12
KEY = "test-key-123"


@pytest.fixture(scope="module")
def ports(base_settings, compute):
    """(gRPC port, HTTP port) of one embedded mesh's gateway; the HTTP API wants KEY."""
    settings = base_settings.with_overrides(drafters=["layers:4"], **{"speculation.depth": 3})
    with served_mesh(settings, compute, frozenset({KEY})) as (grpc_port, http_port, *_):
        yield grpc_port, http_port


@pytest.fixture(scope="module")
def grpc_client(ports):
    with Client(f"127.0.0.1:{ports[0]}", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(ports):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def web(ports):
    with httpx.Client(base_url=f"http://127.0.0.1:{ports[1]}", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_completion_greedy_equals_grpc_with_usage_and_metrics(oai, grpc_client, base_settings):
    reference = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS)
    reply = oai.completions.create(model=base_settings.model, prompt=PROMPT, temperature=0,
                                   max_tokens=MAX_TOKENS,
                                   extra_body={"speculation_metrics": "detailed"})
    assert reply.object == "text_completion"
    assert reply.choices[0].text == reference.text
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage
    assert usage.prompt_tokens == reference.stats.prompt_tokens
    assert usage.completion_tokens == len(reference.token_ids) == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = reply.model_extra["metrics"]["speculative_decoding"]
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["num_accepted_draft_tokens"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == \
        spec["num_draft_tokens"] > 0
    # the metrics agree with the gRPC statistics of the same (deterministic) request
    assert spec["num_accepted_draft_tokens"] == reference.stats.accepted_tokens
    assert spec["num_draft_tokens"] == reference.stats.draft_tokens
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] == \
        len(spec["per_step_accepted"]) > 0
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + sum(spec["per_step_accepted"]) / spec["num_spec_steps"])
    assert len(spec["decisions"]) == reference.stats.steps


def test_chat_greedy_streamed_and_whole_equal_grpc(oai, grpc_client):
    messages = [{"role": "user", "content": QUESTION}]
    reference = grpc_client.chat(messages, max_tokens=MAX_TOKENS)
    whole = oai.chat.completions.create(model="", messages=messages, temperature=0,
                                        max_completion_tokens=MAX_TOKENS)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == reference.text
    stream = oai.chat.completions.create(model="", messages=messages, temperature=0,
                                         max_tokens=MAX_TOKENS, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"speculation_metrics": "summary"})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert "speculative_decoding" in finals[0].model_extra["metrics"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completion_stream_and_seeded_sampling(oai):
    streamed = oai.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, seed=7,
                                      temperature=0.8, top_p=0.9, stream=True)
    text = "".join(c.choices[0].text for c in streamed)
    again = oai.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, seed=7,
                                   temperature=0.8, top_p=0.9, extra_body={"top_k": 20})
    plain = oai.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, seed=7,
                                   temperature=0.8, top_p=0.9)
    assert text == plain.choices[0].text  # the same seed, streamed or not
    assert again.usage.completion_tokens <= MAX_TOKENS


def test_models_and_health(oai, web, base_settings):
    assert [m.id for m in oai.models.list()] == [base_settings.model]
    assert web.get("/health").json() == {"status": "ok"}


BAD = [
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "n": 2}, 400, "n=2 is not supported"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs is not supported"),
    ({"prompt": "hi", "seed": -1}, 400, "seed"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "The model 'gpt-9' does not exist"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m for *_, m in BAD])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(web, body, status, message):
    reply = web.post("/v1/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    ok = web.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_chat_refuses_tools_and_unknown_roles(oai):
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        oai.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}],
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="unknown chat role 'tool'"):
        oai.chat.completions.create(model="", messages=[
            {"role": "tool", "content": "x", "tool_call_id": "1"}])


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic " + KEY])
def test_a_missing_or_wrong_key_is_401(ports, web, header):
    headers = {} if header is None else {"Authorization": header}
    reply = httpx.post(f"http://127.0.0.1:{ports[1]}/v1/completions", headers=headers,
                       json={"prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in reply.text
    assert httpx.get(f"http://127.0.0.1:{ports[1]}/health").status_code == 200  # no key needed
    assert web.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_stream_is_server_sent_events_ending_in_done(web):
    with web.stream("POST", "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 4, "stream": True,
                          "temperature": 0}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    bodies = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
