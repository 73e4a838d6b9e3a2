"""Hostile input, generated (hypothesis): every public field of the gateway's gRPC API and of its
HTTP API, draft trees / pool entries handed straight to the verifier's engine, and anything a
drafts-stream entry of the Redis pool can hold, taken by a running verifier worker. Each is
served or refused (INVALID_ARGUMENT, an HTTP 4xx in OpenAI's shape, an error result, a stale
reply, dead-lettered), nothing crashes, and a good request is served after every example.

One embedded mesh (SmolLM2-135M, a 4-layer truncated draft, at most 4 new tokens a request)
serves the gRPC gateway and the HTTP app; the engine tests use that mesh's verifier engine."""
import asyncio
import json
import math

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, pool_pb2
from threaded import served_mesh

EXAMPLES = 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
GOOD = gateway_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=2)

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.integers(-2**31, 2**31 - 1).map(float))
texts = st.text(max_size=60)
anything = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), numbers, texts,
                     st.lists(st.one_of(texts, st.integers()), max_size=4),
                     st.dictionaries(texts, texts, max_size=2))


@pytest.fixture(scope="module")
def mesh(base_settings, compute):
    """(gRPC port, HTTP port, the mesh, its event loop)."""
    mesh_settings = base_settings.with_overrides(drafters=["layers:4"], max_tokens_limit=4,
                                                 max_tokens_default=4,
                                                 **{"speculation.depth": 2})
    with served_mesh(mesh_settings, compute) as value:
        yield value


@pytest.fixture(scope="module")
def gateway(mesh):
    with grpc.insecure_channel(f"127.0.0.1:{mesh[0]}") as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def still_serving(gateway) -> None:
    assert len(gateway.Generate(GOOD, timeout=120).token_ids) == 2


# ---------------------------------------------------------------------------------------------
# gRPC: every field of GenerateRequest


@st.composite
def generate_requests(draw) -> gateway_pb2.GenerateRequest:
    if draw(st.integers(0, 2)) == 0:  # well-formed: the served path is tried too
        return gateway_pb2.GenerateRequest(
            prompt=draw(st.text(min_size=1, max_size=40).filter(str.strip)),
            max_tokens=draw(st.integers(1, 4)), stop=draw(st.lists(st.text(min_size=1,
                                                                           max_size=4), max_size=2)),
            sampling=common_pb2.SamplingParams(temperature=draw(st.floats(0, 2)),
                                               top_k=draw(st.integers(0, 50)),
                                               seed=draw(st.integers(0, 2**64 - 1))))
    request = gateway_pb2.GenerateRequest(model=draw(st.sampled_from(["", "smollm2-135m", "x"])))
    if draw(st.booleans()):
        request.prompt = draw(st.one_of(texts, st.just("The capital of France is")))
    else:
        for _ in range(draw(st.integers(0, 3))):
            request.messages.messages.add(
                role=draw(st.sampled_from(["user", "system", "assistant", "tool", ""])),
                content=draw(texts))
    if draw(st.booleans()):
        request.max_tokens = draw(st.one_of(st.integers(1, 4), st.integers(-2**31, 2**31 - 1)))
    s = request.sampling  # half the time in range: the served path is tried too
    s.temperature = draw(st.one_of(st.floats(0, 2), numbers))
    s.top_k = draw(st.one_of(st.integers(0, 50), st.integers(-2**31, 2**31 - 1)))
    for name, low, high in (("top_p", 0.01, 1), ("repetition_penalty", 0.5, 2),
                            ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        if draw(st.booleans()):
            setattr(s, name, draw(st.one_of(st.floats(low, high), numbers)))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    request.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)
                             | st.lists(texts, max_size=20)))
    return request


@FUZZ
@given(request=generate_requests())
def test_any_generate_request_is_served_or_invalid(gateway, request):
    try:
        out = gateway.Generate(request, timeout=120)
        assert len(out.token_ids) <= 4
        event("served")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details()
        event("INVALID_ARGUMENT")
    still_serving(gateway)


# ---------------------------------------------------------------------------------------------
# HTTP: any JSON body


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
          "frequency_penalty", "logit_bias", "top_k", "repetition_penalty", "logprobs", "echo",
          "tools", "response_format", "speculation_metrics", "user"]


@st.composite
def bodies(draw) -> dict:
    body = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
        body[name] = draw(anything)
    if draw(st.booleans()):
        body["prompt"] = draw(st.one_of(texts, st.just("The capital of France is")))
    if draw(st.booleans()):  # a well-formed body now and then: the served path is tried too
        body = {"prompt": "Hello", "max_tokens": draw(st.integers(1, 4)),
                "temperature": draw(st.floats(0, 2)), **{k: v for k, v in body.items()
                                                        if k in ("stream", "seed")}}
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "developer", "tool", "x"]),
             "content": st.one_of(texts, st.none(), anything)}), max_size=3))
    return body


@FUZZ
@given(body=bodies(), chat=st.booleans())
def test_any_json_body_gets_a_completion_or_an_openai_4xx(mesh, gateway, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # json.dumps writes NaN and Infinity as bare words: not JSON, which the server must refuse
    reply = httpx.post(f"http://127.0.0.1:{mesh[1]}{path}", content=json.dumps(body),
                       headers={"Content-Type": "application/json"}, timeout=120)
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, reply.text
    event(f"HTTP {reply.status_code}")
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"]
    still_serving(gateway)


# ---------------------------------------------------------------------------------------------
# the verifier: trees and entries straight to its engine


@st.composite
def entries(draw, vocab: int) -> pool_pb2.DraftEntry:
    n = draw(st.integers(0, 48))
    if draw(st.booleans()):  # well-formed: parents before their children, ids in the vocabulary
        tree = common_pb2.TokenTree(
            tokens=draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)),
            parents=[draw(st.integers(-1, i - 1)) for i in range(n)])
    else:
        tree = common_pb2.TokenTree(
            tokens=draw(st.lists(st.integers(-5, vocab + 5), min_size=n, max_size=n)),
            parents=draw(st.lists(st.integers(-3, n + 2), min_size=max(n - 1, 0),
                                  max_size=n + 1)))
    if draw(st.integers(0, 3)) == 0:
        tree.scores.extend(draw(st.lists(numbers, max_size=n + 1)))
    if draw(st.integers(0, 3)) == 0:
        tree.sources.extend(draw(st.lists(st.integers(0, 3), max_size=n + 1)))
        tree.source_names.extend(draw(st.lists(texts, max_size=2)))
    return pool_pb2.DraftEntry(request_id=draw(st.sampled_from(["fuzz", "fuzz", "unknown", ""])),
                               step=draw(st.integers(0, 2**32 - 1)),
                               base_len=draw(st.integers(0, 2**32 - 1)), tree=tree,
                               heads_nodes=draw(st.integers(0, 300)))


@FUZZ
@given(data=st.data())
def test_any_tree_reaching_the_verifier_is_verified_or_refused(mesh, gateway, data):
    _, _, m, loop = mesh
    engine = m.worker.engine
    vocab = engine.lm.vocab_size
    entry = data.draw(entries(vocab))
    state = pool_pb2.RequestState(request_id="fuzz", prompt_ids=[1, 2, 3, 4], seed=1)

    def verify():
        engine.load(state, [])
        try:
            return engine.step_entries([entry])
        finally:
            engine.release("fuzz")
    (out,) = asyncio.run_coroutine_threadsafe(m.worker._run(verify), loop).result(timeout=120)
    event("deferred" if out is None else "refused" if out[0].error else "verified")
    if out is not None:  # None: deferred (not this engine's turn), never an exception
        result, tokens = out
        tree, known = entry.tree, entry.request_id == "fuzz"
        valid = known and len(tree.parents) == len(tree.tokens) and all(
            -1 <= p < i for i, p in enumerate(tree.parents)) and all(
            0 <= t < vocab for t in tree.tokens) and _annotations_fit(tree)
        assert bool(result.error) != valid, (result.error, valid)
        if valid:
            assert tokens == [*result.accepted, result.bonus]
            assert all(math.isfinite(x) for x in (result.verify_seconds,))
    still_serving(gateway)


def _annotations_fit(tree: common_pb2.TokenTree) -> bool:
    n = len(tree.tokens)
    return (len(tree.scores) in (0, n) and len(tree.sources) in (0, n)
            and all(s < len(tree.source_names) for s in tree.sources))


# ---------------------------------------------------------------------------------------------
# the verifier: entries through a real Redis pool to a running worker


@pytest.fixture(scope="module")
def redis_worker(mesh, redis_server):
    """A VerifierWorker on the mesh's engine taking drafts from a Redis pool (a failing entry
    is given up on after its second delivery, reclaimed after 0.5 s idle): (pool, worker)."""
    from specmesh_services.common.pool.redis import RedisPool
    from specmesh_services.verifier.worker import VerifierWorker

    _, _, m, loop = mesh
    settings = m.settings.verifier.model_copy(update={"claim_idle_s": 0.5,
                                                       "max_deliveries": 2})

    async def start():
        pool = RedisPool(redis_server.url, prefix="fuzz-entries")
        worker = VerifierWorker(m.worker.engine, pool, m.worker.executor, settings)
        worker.start()
        return pool, worker
    pool, worker = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    yield pool, worker, loop
    asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)
    asyncio.run_coroutine_threadsafe(pool.close(), loop).result(timeout=60)


@st.composite
def stream_entries(draw, vocab: int) -> bytes:
    """What a drafts-stream entry's data can hold: a DraftEntry (any tree, any request id, a
    tree far over the node budget, an empty one) or bytes that are none."""
    kind = draw(st.sampled_from(["entry", "entry", "entry", "oversized", "empty", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    entry = (pool_pb2.DraftEntry() if kind == "empty" else draw(entries(vocab)))
    if kind == "entry" and draw(st.booleans()):
        entry.base_len = 0  # the request's own count: applied, if the tree is sound
    if kind == "oversized":
        n = draw(st.integers(5_000, 20_000))
        entry.tree.tokens[:] = [1] * n
        entry.tree.parents[:] = list(range(-1, n - 1))
    entry.reply_to = "fuzz-router"
    return entry.SerializeToString()


@FUZZ
@given(data=st.data())
def test_any_pool_entry_is_verified_refused_or_dead_lettered_and_the_worker_serves_on(
        mesh, redis_worker, data):
    """Each entry leaves the pool (verified, answered with an error or a stale reply, dropped
    for an unknown request, or dead-lettered with its reason); the worker's loop survives, and a
    good draft of another request is verified after it."""
    pool, worker, loop = redis_worker
    data_bytes = data.draw(stream_entries(worker.engine.lm.vocab_size))

    async def example():
        await pool.put_request(pool_pb2.RequestState(request_id="fuzz", prompt_ids=[1, 2, 3, 4],
                                                     seed=1), 60)
        dead = len(await pool.dead_letters(10_000))
        await pool._redis.xadd(pool._drafts, {"data": data_bytes})
        await until(lambda: _empty(pool), "the entry to leave the pool")
        answers = await pool.results("fuzz-router", 0.05)
        dead_lettered = len(await pool.dead_letters(10_000)) > dead
        outcome = ("dead-lettered" if dead_lettered else "dropped" if not answers else
                   "stale" if answers[0].stale else "refused" if answers[0].error
                   else "verified")
        assert all(task.done() is False for task in worker._tasks), "the worker's loop died"
        # a good draft is served after it
        await pool.put_request(pool_pb2.RequestState(request_id="good", prompt_ids=[1, 2, 3],
                                                     seed=1), 60)
        await pool.submit(pool_pb2.DraftEntry(request_id="good", step=0, base_len=0,
                                              reply_to="fuzz-good"))
        (good,) = await until_result(pool, "fuzz-good")
        assert not good.error and not good.stale
        for rid in ("fuzz", "good"):
            await pool.delete_request(rid)
        return outcome

    event(asyncio.run_coroutine_threadsafe(example(), loop).result(timeout=120))


async def _empty(pool) -> bool:
    return await pool.pending() == 0


async def until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = loop_time() + timeout
    while not await predicate():
        assert loop_time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def until_result(pool, router: str, timeout: float = 60.0):
    deadline = loop_time() + timeout
    while True:
        found = await pool.results(router, 0.5)
        if found:
            return found
        assert loop_time() < deadline, "no result for the good draft"


def loop_time() -> float:
    return asyncio.get_running_loop().time()
