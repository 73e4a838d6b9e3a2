"""`specmesh up --secure` as processes: mutual TLS between every service and on the gateway
(gRPC and HTTPS), an API key on the gateway, Redis with a password over TLS. The secure stack's
greedy output is the target's own; a call without the key or with a wrong one is refused
(UNAUTHENTICATED / 401) and the gateway keeps serving; a plaintext client gets nowhere; the key
and the Redis password appear in no log and not in the state the stack describes."""
import json

import grpc
import httpx
import openai
import pytest

from specmesh import Client, Unauthenticated, Unavailable
from specmesh_services.launch.procs import free_port
from specmesh_services.launch.stack import Stack
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

QUESTIONS = 2
MAX_TOKENS = 32  # the references' first 32: the TLS path is what is under test here


@pytest.fixture(scope="module")
def secure(base_settings, tmp_path_factory):
    settings = base_settings.with_overrides(run_dir=tmp_path_factory.mktemp("secure-run"),
                                            drafters=["layers:8"], pool_prefix="test-secure",
                                            **{"speculation.depth": 3, "gateway.http_port": 0})
    stack = Stack(settings, free_port(), tmp_path_factory.mktemp("secure-logs"), secure=True)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def client(stack, key: str | None = None, tls: bool = True) -> Client:
    folder = stack.secure_dir
    credentials = grpc.ssl_channel_credentials((folder / "ca.pem").read_bytes(),
                                               (folder / "service-key.pem").read_bytes(),
                                               (folder / "service.pem").read_bytes()) \
        if tls else None
    return Client(f"127.0.0.1:{stack.gateway_port}", timeout=300, credentials=credentials,
                  api_key=key)


def api_key(stack) -> str:
    return (stack.secure_dir / "api_key").read_text().strip()


def test_the_secure_stack_serves_the_targets_greedy_output(secure, questions,
                                                          hf_greedy_reference):
    assert secure.settings.tls.mutual and secure.settings.redis_url.startswith("rediss://:")
    with client(secure, api_key(secure)) as c:
        outputs = [c.chat([{"role": "user", "content": q["turns"][0]}], max_tokens=MAX_TOKENS)
                   for q in questions[:QUESTIONS]]
    assert_target_tokens(outputs, hf_greedy_reference[:QUESTIONS], MAX_TOKENS)
    assert sum(o.stats.accepted_tokens for o in outputs) > 0


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no key", "wrong key"])
def test_a_missing_or_wrong_key_is_unauthenticated_and_the_gateway_stays_up(secure, key):
    with client(secure, key) as c, pytest.raises(Unauthenticated) as err:
        c.generate("Hello", max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in err.value.message
    with client(secure, api_key(secure)) as c:
        assert len(c.generate("Hello", max_tokens=2).token_ids) == 2


def test_https_wants_the_key_and_the_ca(secure):
    ca = str(secure.secure_dir / "ca.pem")
    url = secure.http_url
    assert url.startswith("https://")
    refused = httpx.post(f"{url}/completions", verify=ca, json={"prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(verify=ca) as http_client:
        oai = openai.OpenAI(base_url=url, api_key=api_key(secure), http_client=http_client,
                            max_retries=0)
        assert oai.completions.create(model="", prompt="Hi", max_tokens=2,
                                      temperature=0).usage.completion_tokens == 2
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the local CA
        httpx.get(f"{url.removesuffix('/v1')}/health")


def test_plaintext_clients_get_nowhere(secure):
    with client(secure, api_key(secure), tls=False) as c, pytest.raises(Unavailable):
        c.generate("Hello", max_tokens=2, timeout=10)


def test_no_secret_in_logs_or_state(secure):
    key = api_key(secure)
    password = secure.redis.password
    texts = [p.read_text(errors="replace") for p in secure.log_dir.glob("*.log")]
    texts.append(json.dumps(secure.describe()))
    assert texts and not any(key in t or password in t for t in texts)
    assert ":***@" in secure.describe()["redis_url"]
