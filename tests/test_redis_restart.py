"""Redis restarted mid-stream under the multi-process stack: with the append-only file the
deployment configures (compose and k8s), the pool's requests, drafts and consumer groups come
back; the services reconnect (the router retries its submits with backoff and submits again a
tree the pool lost), and the request's tokens are the target's own."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh import Client
from specmesh_services.launch.procs import free_port
from specmesh_services.launch.redis_server import RedisServer
from specmesh_services.launch.stack import Stack

AFTER_TOKENS = 16  # after the restart the stack serves on: a short request shows it


@pytest.fixture(scope="module")
def aof_redis():
    with RedisServer(appendonly=True) as server:
        yield server


@pytest.fixture(scope="module")
def stack(base_settings, aof_redis, tmp_path_factory):
    settings = base_settings.with_overrides(
        redis_url=aof_redis.url, pool_prefix="test-restart", drafters=["layers:8"],
        **{"speculation.depth": 3, "router.resubmit_s": 1.0, "verifier.claim_idle_s": 2.0,
           "gateway.http_port": None})
    s = Stack(settings, free_port(), tmp_path_factory.mktemp("restart-logs"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def test_redis_restarted_mid_stream_loses_nothing(stack, aof_redis, questions,
                                                   hf_greedy_reference):
    messages = [{"role": "user", "content": questions[4]["turns"][0]}]
    started = threading.Event()

    def stream(c):
        tokens = []
        for chunk in c.stream_chat(messages, max_tokens=64):
            tokens += chunk.token_ids
            started.set()
        return tokens
    with Client(f"127.0.0.1:{stack.gateway_port}", timeout=300) as c, \
            ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, c)
        assert started.wait(timeout=120)
        aof_redis.restart()
        tokens = future.result(timeout=300)
        assert tokens == hf_greedy_reference[4]
        after = c.chat(messages, max_tokens=AFTER_TOKENS)  # and the stack serves on
    assert list(after.token_ids) == hf_greedy_reference[4][:AFTER_TOKENS]
    assert all(child.alive() for child in stack.children)
