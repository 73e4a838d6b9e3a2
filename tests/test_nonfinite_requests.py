"""Non-finite numbers in requests: every float field of every service's request messages refuses
NaN, +inf and -inf with INVALID_ARGUMENT and a message naming the field, and the gateway serves
the next good request exactly as before.

One embedded mesh (SmolLM2-135M, a 4-layer truncated draft) serves its gateway, router and drafter
servicers over real gRPC on a free port; every case shares it and asks for 4 tokens."""
import math

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from specmesh import Client, InvalidRequest
from specmesh.v1 import (common_pb2, datastore_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2,
                         router_pb2, router_pb2_grpc, verifier_pb2)
from specmesh_services.common.sampling import FLOAT_FIELDS, SamplingParams
from specmesh_services.drafter.engine import DraftJob, check_job
from threaded import served_mesh

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
PROMPT = "The capital of France is"
MAX_TOKENS = 4
SERVICES = [gateway_pb2, router_pb2, drafter_pb2, datastore_pb2, verifier_pb2]
# every float field reachable from a request message, and who validates it
VALIDATED = {f"{message}.sampling.{name}" for message in ("GenerateRequest", "RouteRequest")
             for name in FLOAT_FIELDS} | {"DraftBatchRequest.items.min_probability"} | {
    f"DraftPrefillRequest.sampling.{name}" for name in FLOAT_FIELDS}


def _float_fields(message, prefix: str) -> set[str]:
    out = set()
    for field in message.fields:
        path = f"{prefix}.{field.name}"
        if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            out.add(path)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            out |= _float_fields(field.message_type, path)
    return out


def test_every_float_field_of_every_request_is_validated():
    """A float field added to a request message fails this until its validation is added."""
    found = set()
    for module in SERVICES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found |= _float_fields(method.input_type, method.input_type.name)
    assert found == VALIDATED
    assert set(FLOAT_FIELDS) == {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields
                                 if f.type == FieldDescriptor.TYPE_FLOAT}


# ---------------------------------------------------------------------------------------------
# the validation functions


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_sampling_refuses_non_finite(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number, got {value}$"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
def test_draft_refuses_non_finite_min_probability(value):
    with pytest.raises(ValueError, match=f"^min_probability must be a finite number, got {value}$"):
        check_job(DraftJob("r", [], 2, 1, value))


@pytest.mark.parametrize("job,message", [
    (DraftJob("r", [], 65, 1), "depth must be in [0, 64]"),
    (DraftJob("r", [], 2, 65), "width must be in [0, 64]"),
    (DraftJob("r", [], 2, 1, 1.0), "min_probability must be in [0, 1)"),
    (DraftJob("r", [], 2, 1, -0.1), "min_probability must be in [0, 1)"),
])
def test_draft_shape_out_of_range(job, message):
    with pytest.raises(ValueError) as err:
        check_job(job)
    assert message in str(err.value)


# ---------------------------------------------------------------------------------------------
# over gRPC


@pytest.fixture(scope="module")
def mesh_port(base_settings, compute):
    """Port of a gRPC server with an embedded mesh's gateway, router and drafter servicers; the
    mesh and the server run on their own event loop in a thread."""
    settings = base_settings.with_overrides(drafters=["layers:4"], **{"speculation.depth": 2})
    with served_mesh(settings, compute, backends=True) as (port, *_):
        yield port


@pytest.fixture(scope="module")
def client(mesh_port):
    with Client(f"127.0.0.1:{mesh_port}", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def plain(client):
    """The plain greedy request's output, before any bad request."""
    return client.generate(PROMPT, max_tokens=MAX_TOKENS).token_ids


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_gateway_refuses_non_finite_then_serves(client, plain, field, value):
    with pytest.raises(InvalidRequest) as err:
        client.generate(PROMPT, max_tokens=MAX_TOKENS, **{field: value})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} must be a finite number" in err.value.message
    assert client.generate(PROMPT, max_tokens=MAX_TOKENS).token_ids == plain


def test_gateway_stream_refuses_non_finite_then_serves(client, plain):
    with pytest.raises(InvalidRequest, match="top_p must be a finite number"):
        list(client.stream_chat([("user", "hi")], max_tokens=MAX_TOKENS, top_p=math.nan))
    chunks = list(client.stream(PROMPT, max_tokens=MAX_TOKENS))
    assert [t for c in chunks for t in c.token_ids] == plain


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_router_refuses_non_finite(mesh_port, field, value):
    request = router_pb2.RouteRequest(prompt_ids=[1, 2, 3], max_tokens=MAX_TOKENS,
                                      sampling=common_pb2.SamplingParams(**{field: value}))
    with grpc.insecure_channel(f"127.0.0.1:{mesh_port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} must be a finite number" in err.value.details()


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
def test_drafter_refuses_non_finite_then_drafts(mesh_port, value):
    with grpc.insecure_channel(f"127.0.0.1:{mesh_port}") as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        stub.Prefill(drafter_pb2.DraftPrefillRequest(request_id="r", token_ids=[1, 2, 3]),
                     timeout=60)
        item = drafter_pb2.DraftItem(request_id="r", depth=2, width=1, min_probability=value)
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(drafter_pb2.DraftBatchRequest(items=[item]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "min_probability must be a finite number" in err.value.details()
        item.min_probability = 0.0
        response = stub.Draft(drafter_pb2.DraftBatchRequest(items=[item]), timeout=60)
        assert len(response.trees[0].tokens) == 2
        stub.Release(drafter_pb2.DraftReleaseRequest(request_ids=["r"]), timeout=60)


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
def test_drafter_prefill_refuses_non_finite_sampling(mesh_port, value):
    """A sampled prefill's parameters (coupled drafting) are checked like the gateway's."""
    with grpc.insecure_channel(f"127.0.0.1:{mesh_port}") as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        request = drafter_pb2.DraftPrefillRequest(
            request_id="r", token_ids=[1, 2, 3], target_vocab_size=100,
            sampling=common_pb2.SamplingParams(temperature=value, seed=1))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature must be a finite number" in err.value.details()

