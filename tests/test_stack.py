"""The multi-process stack over real Redis: gateway, router, drafter, datastore and verifier as
separate processes (what `specmesh up` starts), talked to with the gRPC client SDK. The router
drafts with the draft model, the lookup datastore and the verifier's draft heads.

Lossless greedy identity on 8 MT-Bench questions (4 in flight), invalid input rejected with
INVALID_ARGUMENT while the services stay up, streaming = unary, seeded sampling reproducible,
one trace per request across all five services (exported over OTLP to a test collector), a
cancelled stream releases its request, and failures lose nothing: a killed verifier's step is
claimed by a new one, dead drafting services leave only the heads drafting, a killed router's
streams go on on the other router, a verifier and then a router drain on SIGTERM without losing
output. Two verifiers and two routers; the failure tests run last. The stack runs with split cores: the verifier's and the drafting roles' compute
threads pinned to disjoint cores (checked from /proc), every result above on top of it.
"""
import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from otlp import Collector
from specmesh_services.common import cores
from specmesh_services.launch.procs import free_port
from specmesh_services.launch.stack import Stack
from specmesh import AsyncClient, Client, InvalidRequest
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_QUESTIONS = 8  # lossless on 20 is tested embedded (test_lossless_greedy); here: the wire
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def collector():
    with Collector() as c:
        yield c


@pytest.fixture(scope="module")
def stack(base_settings, redis_server, collector, tmp_path_factory, small_datastore):
    settings = base_settings.with_overrides(
        redis_url=redis_server.url, pool_prefix="test-stack", cores="split",
        drafters=["layers:24", "heads"],
        **{"speculation.depth": 2, "speculation.width": 1, "verifier.claim_idle_s": 2.0,
           "speculation.source": "both", "speculation.max_nodes": 6,
           # the router's mechanisms on across processes: LBSS over the datastore, the draft
           # model, the verifier's heads and their vote (the router asks the drafter service
           # for its models), with adaptive tree sizes
           "speculation.selection": "lbss", "speculation.voting": True,
           "speculation.slot_s": 0.5, "speculation.tree_size": "adaptive",
           "datastore.path": small_datastore, "gateway.http_port": 0,
           "telemetry.otlp_endpoint": f"127.0.0.1:{collector.port}"})
    s = Stack(settings, free_port(), tmp_path_factory.mktemp("stack-logs"), verifiers=2, routers=2)
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(stack):
    with Client(f"127.0.0.1:{stack.gateway_port}", timeout=300) as c:
        yield c


def test_multiprocess_greedy_equals_target_generate(stack, questions, hf_greedy_reference):
    async def run():
        gate = asyncio.Semaphore(4)
        async with AsyncClient(f"127.0.0.1:{stack.gateway_port}", timeout=600) as client:
            async def one(q):
                async with gate:
                    return await client.chat([{"role": "user", "content": q["turns"][0]}],
                                             max_tokens=MAX_TOKENS)
            return await asyncio.gather(*(one(q) for q in questions[:NUM_QUESTIONS]))
    outputs = asyncio.run(run())
    assert_target_tokens(outputs, hf_greedy_reference)
    assert sum(o.stats.accepted_tokens for o in outputs) > 0
    # every step's decision reaches the client through the gateway and the SDK
    assert all(len(o.stats.decisions) == o.stats.steps > 0 for o in outputs)
    arms = {d.arm for o in outputs for d in o.stats.decisions[1:]}
    assert arms <= {"datastore", "smollm2-135m:layers=24", "heads", "vote"} and len(arms) > 1, \
        arms


def test_openai_client_through_the_stack_equals_the_grpc_api(stack, client):
    """The gateway process's HTTP API (the official `openai` client) gives the gRPC API's
    greedy output and statistics, streamed or not."""
    import openai

    oai = openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is a river?"}]
    reference = client.chat(messages, max_tokens=24)
    reply = oai.chat.completions.create(model="", messages=messages, temperature=0,
                                        max_tokens=24)
    assert reply.choices[0].message.content == reference.text
    assert reply.usage.completion_tokens == len(reference.token_ids)
    streamed = oai.completions.create(model="", prompt="The sky is", temperature=0,
                                      max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == \
        client.generate("The sky is", max_tokens=8).text


INVALID = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="word " * 9000), "prompt is too long"),
    (dict(prompt="hi", max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt="hi", max_tokens=-5), "max_tokens must be >= 1"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens=1000000 is too large"),
    (dict(prompt="hi", temperature=-1.0), "temperature must be >= 0"),
    (dict(prompt="hi", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt="hi", top_k=-1), "top_k must be >= 0"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    (dict(prompt="hi", frequency_penalty=float("nan")),
     "frequency_penalty must be a finite number"),
    (dict(prompt="hi", model="gpt-9"), "unknown model 'gpt-9'"),
    (dict(messages=[]), "messages is empty"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "unknown chat role 'wizard'"),
    (dict(prompt="hi", stop=[""]), "stop sequences must be non-empty"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m for _, m in INVALID])
def test_bad_input_is_invalid_argument_and_services_stay_up(client, kwargs, message):
    call = client.chat if "messages" in kwargs else client.generate
    arg = kwargs.pop("messages") if "messages" in kwargs else kwargs.pop("prompt")
    with pytest.raises(InvalidRequest) as err:
        call(arg, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.message
    ok = client.generate("The sky is", max_tokens=3)
    assert len(ok.token_ids) >= 1


def test_stream_equals_unary_and_stats_are_filled(client):
    unary = client.generate("Here is a short poem about the sea:", max_tokens=24)
    chunks = list(client.stream("Here is a short poem about the sea:", max_tokens=24))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    assert [c.finish_reason for c in chunks].count(None) == len(chunks) - 1
    last = chunks[-1]
    assert last.finish_reason == unary.finish_reason == "length"
    s = unary.stats
    assert s.completion_tokens == 24 and s.steps >= 1 and s.prompt_tokens > 0
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.steps)
    assert s.draft_tokens >= s.accepted_tokens and s.total_time_s >= s.time_to_first_token_s


def test_stop_sequence_ends_the_text(client):
    out = client.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=40, stop=["12"])
    assert "12" not in out.text and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    a = client.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=5)
    b = client.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=5)
    c = client.generate("Once upon a time", max_tokens=20, temperature=1.0, seed=6)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_one_trace_spans_all_services(client, collector):
    out = client.generate("Traces:", max_tokens=6)
    def complete(spans):
        ids = {s.trace_id for s in spans if s.attributes.get("specmesh.request_id") == out.request_id}
        trace = [s for s in spans if s.trace_id in ids]
        services = {s.service for s in trace}
        # Each service exports on its own schedule: a verifier's batch can arrive before the
        # router's batch holding the parent span, so wait for those parents too.
        span_ids = {s.span_id for s in trace}
        parents_in = all(s.parent_id in span_ids for s in trace if s.name == "verifier.verify")
        return parents_in and {"specmesh-gateway", "specmesh-router", "specmesh-drafter",
                               "specmesh-datastore", "specmesh-verifier"} <= services
    spans = collector.wait_for(complete)
    trace_ids = {s.trace_id for s in spans if s.attributes.get("specmesh.request_id") == out.request_id}
    assert len(trace_ids) == 1, "all of a request's spans share one trace"
    trace = [s for s in spans if s.trace_id in trace_ids]
    services = {s.service for s in trace}
    assert {"specmesh-gateway", "specmesh-router", "specmesh-drafter",
            "specmesh-datastore", "specmesh-verifier"} <= services
    by_id = {s.span_id: s for s in trace}
    verifies = [s for s in trace if s.name == "verifier.verify"]
    assert verifies and all(getattr(by_id.get(v.parent_id), "name", None) == "router.submit"
                            for v in verifies), \
        "verifier spans are children of the router span that submitted the tree to the pool"


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def child(stack, name):
    """The newest process named `name` (a role, or a replica's name: "router-2")."""
    return next(c for c in reversed(stack.children) if c.name == name)


def live(stack, role):
    return [c for c in stack.children if c.role == role and c.process.poll() is None]


def verifier_info(stack, name="verifier"):
    with grpc.insecure_channel(f"127.0.0.1:{child(stack, name).port}") as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.VerifierInfoRequest(),
                                                            timeout=5)


def verifiers_total(stack, field):
    """`field` of VerifierInfo summed over the live verifiers."""
    return sum(getattr(verifier_info(stack, c.name), field) for c in live(stack, "verifier"))


def drafter_info(stack):
    with grpc.insecure_channel(f"127.0.0.1:{child(stack, 'drafter').port}") as channel:
        return drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(),
                                                          timeout=5)


def pool_keys(stack, kind):
    with redis.Redis.from_url(stack.settings.redis_url) as r:
        return r.keys(f"{stack.settings.pool_prefix}:{kind}:*")


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct core sets of a process's threads."""
    return {frozenset(os.sched_getaffinity(int(task.name)))
            for task in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_split_cores_pin_the_verifier_and_the_drafter_apart(stack):
    """The compute thread (and its OpenMP team) of each model role on the role's own cores;
    the other threads (gRPC, asyncio) free."""
    plan, every = cores.plan("split"), frozenset(os.sched_getaffinity(0))
    for role, own in (("verifier", plan.verifier), ("drafter", plan.drafting),
                      ("datastore", plan.drafting)):
        for c in live(stack, role):
            assert thread_cores(c.process.pid) == {own, every}, c.name


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


def test_metrics_of_every_service_agree_with_the_requests_statistics(stack, client):
    """Each process serves /metrics; the router's vLLM-named speculation counters, per-source
    counters and request histograms, and the verifier's counters, move by exactly what the
    requests' own statistics say."""
    urls = {c.name: f"http://127.0.0.1:{c.metrics_port}/metrics" for c in stack.children}
    roles = {c.name: c.role for c in stack.children}
    before = {name: scrape(url) for name, url in urls.items()}
    outs: list = []
    for _ in range(5):  # until a tree was drafted: the adaptive size may start a request off
        outs += [client.generate(p, max_tokens=16) for p in ("The sky is", "def add(a, b):",
                                                            "Once upon a time")]
        if any(o.stats.draft_tokens for o in outs):
            break
    after = {name: scrape(url) for name, url in urls.items()}

    def moved(role, metric, **labels):  # summed over the role's replicas
        return sum(total(after[n], metric, **labels) - total(before[n], metric, **labels)
                   for n in urls if roles[n] == role)

    drafted = sum(o.stats.draft_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    trees = sum(1 for o in outs for d in o.stats.decisions if d.tree_size)
    assert drafted > 0, [[(d.arm, d.budget, d.tree_size) for d in o.stats.decisions]
                         for o in outs]
    assert moved("router", "vllm:spec_decode_num_draft_tokens_total") == drafted
    assert moved("router", "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert moved("router", "vllm:spec_decode_num_drafts_total") == trees
    assert moved("router", "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert moved("router", "specmesh:spec_decode_draft_tokens_by_source_total") == drafted
    assert moved("router", "specmesh:spec_decode_accepted_tokens_by_source_total") == accepted
    assert moved("router", "vllm:generation_tokens_total") == sum(len(o.token_ids) for o in outs)
    assert moved("router", "vllm:e2e_request_latency_seconds_count") == len(outs)
    assert moved("router", "vllm:time_to_first_token_seconds_count") == len(outs)
    assert moved("router", "vllm:request_success_total", finished_reason="length") == len(outs)
    assert moved("verifier", "specmesh_verifier_drafted_tokens_total") == drafted
    assert moved("verifier", "specmesh_verifier_accepted_tokens_total") == accepted
    assert 0 <= total(after["verifier"], "vllm:kv_cache_usage_perc") <= 1
    # every service times the calls it serves (the drafter's and datastore's latency)
    for role in set(roles.values()):
        assert sum(total(after[n], "specmesh:rpc_server_seconds_count")
                   for n in urls if roles[n] == role) > 0, role
    assert moved("gateway", "specmesh:rpc_server_seconds_count",
                 method="Generate", code="OK") == len(outs)


def test_every_service_lists_itself_by_reflection(stack):
    """What `grpcurl -plaintext HOST:PORT list` prints, through the reflection client; and a
    method's request type resolves (what `grpcurl describe` and calls need)."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    for c in stack.children:
        with grpc.insecure_channel(f"127.0.0.1:{c.port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            own = f"specmesh.v1.{c.role.capitalize()}"
            assert services == common | {own}, (c.role, services)
            found = database.FindFileContainingSymbol(own)
            assert found.name.startswith("specmesh/v1/"), found.name


def test_drafter_reports_its_models_and_their_measured_cost(stack):
    """The router's estimate of a model's drafting cost before it has timed drafts."""
    with grpc.insecure_channel(f"127.0.0.1:{child(stack, 'drafter').port}") as channel:
        info = drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(),
                                                          timeout=5)
    assert [(m.name, m.kind, m.num_layers) for m in info.models] == [
        ("smollm2-135m:layers=24", "truncated", 24)]
    assert 0 < info.models[0].level_seconds < 5


def test_cancelled_stream_releases_the_request(stack, client):
    """A client gone mid-stream frees everything its request held: pool state, the verifier's
    KV rows, the drafter's draft state (counted)."""
    stream = client.stream("Write a very long story about a dragon.", max_tokens=400)
    assert next(stream).token_ids
    stream.close()  # the client goes away mid-generation
    wait_until(lambda: not pool_keys(stack, "req"), what="the pool state to be dropped")
    wait_until(lambda: verifiers_total(stack, "active_requests") == 0
               and verifiers_total(stack, "kv_used_tokens") == 0,
               what="the verifiers to free the request's KV rows")
    wait_until(lambda: drafter_info(stack).held_requests == 0,
               what="the drafter to drop the request's draft state")


def test_killed_verifier_loses_nothing(stack, questions, hf_greedy_reference):
    """A verifier dies mid-request; the other (or a new one) claims the unacknowledged tree,
    re-prefilling from the pool's durable state where it lacks the request, and the output is
    still the target's own."""
    messages = [{"role": "user", "content": questions[0]["turns"][0]}]
    with Client(f"127.0.0.1:{stack.gateway_port}", timeout=300) as c, \
            ThreadPoolExecutor(1) as pool:
        before = verifiers_total(stack, "steps")
        future = pool.submit(c.chat, messages, max_tokens=MAX_TOKENS)
        wait_until(lambda: pool_keys(stack, "tok") and verifiers_total(stack, "steps") > before + 3,
                   what="generation to start")
        old = child(stack, "verifier")
        old.process.send_signal(signal.SIGKILL)
        old.process.wait()
        steps = verifiers_total(stack, "steps")  # the survivor's
        stack.wait_healthy(stack.spawn("verifier", free_port(), stack.settings))
        out = future.result(timeout=300)
    assert out.token_ids == hf_greedy_reference[0]
    assert verifiers_total(stack, "steps") > steps, "the request went on after the kill"


def health_of(stack, role) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{child(stack, role).port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=2)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_a_verifier_drains_on_sigterm_and_nothing_is_lost(stack, questions,
                                                         hf_greedy_reference):
    """SIGTERM mid-request: the verifier reports NOT_SERVING, finishes its step and exits well
    within its drain period; a new verifier takes over and the output is the target's own."""
    messages = [{"role": "user", "content": questions[2]["turns"][0]}]
    before = verifiers_total(stack, "steps")
    with Client(f"127.0.0.1:{stack.gateway_port}", timeout=300) as c, \
            ThreadPoolExecutor(1) as pool:
        future = pool.submit(c.chat, messages, max_tokens=MAX_TOKENS)
        wait_until(lambda: verifiers_total(stack, "steps") > before + 3,
                   what="generation to start")
        old = child(stack, "verifier")
        began = time.monotonic()
        old.process.send_signal(signal.SIGTERM)
        old.process.wait(timeout=stack.settings.drain_s + 5)
        drained_s = time.monotonic() - began
        log = old.log.read_text()  # before its successor's log replaces it
        stack.wait_healthy(stack.spawn("verifier", free_port(), stack.settings))
        out = future.result(timeout=300)
    assert out.token_ids == hf_greedy_reference[2]
    assert old.process.returncode == 0 and drained_s < stack.settings.drain_s
    assert "verifier draining" in log and "verifier drained in" in log


def test_dead_drafting_services_leave_the_verifiers_heads_without_losing_output(
        stack, client, questions, hf_greedy_reference):
    killed = []
    for role in ("drafter", "datastore"):  # first the model drafter, then the datastore too
        killed.append(child(stack, role))
        killed[-1].process.send_signal(signal.SIGKILL)
        killed[-1].process.wait()
        out = client.chat([{"role": "user", "content": questions[1]["turns"][0]}],
                          max_tokens=MAX_TOKENS)
        assert out.token_ids == hf_greedy_reference[1], role
    # only the heads (served by the verifier) still draft
    assert {name for d in out.stats.decisions for name in d.drafters} <= {"heads"}
    for dead in killed:  # back, for the tests after this one
        stack.restart(dead)


def streams_in_flight(stack, prompts, act):
    """Streams `prompts` at once; once each has a chunk, `act()`; every stream's chunks."""
    started = [threading.Event() for _ in prompts]

    def stream(c, i):
        chunks = []
        for chunk in c.stream_chat([{"role": "user", "content": prompts[i]}],
                                   max_tokens=MAX_TOKENS):
            chunks.append(chunk)
            started[i].set()
        return chunks
    with Client(f"127.0.0.1:{stack.gateway_port}", timeout=300) as c, \
            ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, c, i) for i in range(len(prompts))]
        assert all(e.wait(timeout=180) for e in started), "the streams did not start"
        act()
        return [f.result(timeout=300) for f in futures]


def test_a_killed_routers_streams_go_on_on_the_other_router(stack, client, questions,
                                                           hf_greedy_reference):
    """SIGKILL a router with streams in flight (the gateway spreads 4 over the 2 routers): the
    gateway resumes each of its streams on the other router from the request's state in the
    pool; every stream's tokens are the target's own and its text the undisturbed run's, no
    token repeated or skipped. The router comes back on its port, as `specmesh up` restarts it."""
    ids = range(4, 8)
    prompts = [questions[i]["turns"][0] for i in ids]
    dead = child(stack, "router")
    streams = streams_in_flight(stack, prompts, lambda: dead.process.send_signal(signal.SIGKILL))
    dead.process.wait()
    for i, chunks in zip(ids, streams):
        assert [t for ch in chunks for t in ch.token_ids] == hf_greedy_reference[i], i
        assert chunks[-1].finish_reason
    with ThreadPoolExecutor(len(prompts)) as pool:  # batched by the verifier, as the streams were
        undisturbed = list(pool.map(lambda p: client.chat([{"role": "user", "content": p}],
                                                          max_tokens=MAX_TOKENS), prompts))
    assert ["".join(ch.text for ch in chunks) for chunks in streams] == \
        [o.text for o in undisturbed]
    assert "going on after" in child(stack, "gateway").log.read_text()
    stack.restart(dead)


def test_chaos_a_random_service_killed_every_few_seconds_loses_nothing(stack, questions,
                                                                      hf_greedy_reference):
    """bench/chaos.py at a small scale: 4 streams in flight, at least 16 requests and on until
    a verifier, a router, the drafter and the datastore, in turn, have been SIGKILLed every 3 s
    (once the last one serves again) and started again on their ports; every output is the
    target's own. The load outlasts the kills however slowly the host restarts a process."""
    from bench.chaos import Chaos
    from bench.load import Prompt, run_load

    ids = range(10, 14)
    prompts = [Prompt(f"mtbench-{i}", ({"role": "user", "content": questions[i]["turns"][0]},))
               for i in ids]
    chaos = Chaos(stack, every_s=3.0, seed=3, in_turn=True, limit=4)
    stats = chaos.during(lambda: asyncio.run(run_load(
        f"127.0.0.1:{stack.gateway_port}", prompts, [hf_greedy_reference[i] for i in ids],
        MAX_TOKENS, concurrency=4, until=lambda sent: sent >= 16 and chaos.finished())))
    print("chaos:", stats.summary(), "kills:", chaos.kills)
    assert not stats.errors and not stats.mismatched, stats.summary()
    assert stats.requests == stats.identical >= 16
    killed = {name.split("-")[0] for _, name, _ in chaos.kills}
    assert killed == {"verifier", "router", "drafter", "datastore"}, chaos.kills


def test_a_router_drains_on_sigterm_finishing_its_streams(stack, questions, hf_greedy_reference):
    """SIGTERM mid-stream (last: the stack has one router less after it): the router reports
    NOT_SERVING, takes no new request, finishes (or hands back) its streams, then exits; every
    stream's output is the target's own."""
    ids = range(8, 10)
    router = child(stack, "router")

    def terminate():
        router.process.send_signal(signal.SIGTERM)
        wait_until(lambda: health_of(stack, "router") != "SERVING", timeout=10,
                   what="NOT_SERVING")
    streams = streams_in_flight(stack, [questions[i]["turns"][0] for i in ids], terminate)
    for i, chunks in zip(ids, streams):
        assert [t for ch in chunks for t in ch.token_ids] == hf_greedy_reference[i], i
    router.process.wait(timeout=stack.settings.drain_s + 5)
    assert router.process.returncode == 0
    assert "router drained in" in router.log.read_text()
