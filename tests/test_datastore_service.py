"""The lookup datastore as a service: the gRPC service on a real port with a datastore built
from real ShareGPT records and the default model's tokenizer, the corpus readers, the CLI, the
tokenizer-family check, and lossless greedy decoding with the datastore as the only drafter
(embedded mesh, 20 MT-Bench questions, == the target's own `generate`)."""
from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from specmesh_services.common.rpc import channel
from specmesh_services.common.datastore_files import DatastoreMismatch, tokenizer_family
from specmesh_services.datastore import corpus
from specmesh_services.datastore.server import build_engine, start
from specmesh_services.launch import cli
from specmesh_services.launch.embedded import EmbeddedMesh
from specmesh_services.router.server import check_datastore
from specmesh.v1 import datastore_pb2, datastore_pb2_grpc
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_QUESTIONS = 20
MAX_TOKENS = 64


def test_truncated_sharegpt_json_is_read_record_by_record(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}, '
                    '{"from": "gpt", "value": "hello"}, {"from": "system", "value": "x"}]},\n'
                    ' {"id": "b", "conversations": [{"from": "human", "value": "cut he')
    assert list(corpus.iter_texts(path)) == ["hi", "hello"]
    lines = tmp_path / "c.jsonl"
    lines.write_text('{"text": "one"}\n"two"\n{"messages": [{"role": "user", "content": "3"}]}\n')
    assert list(corpus.iter_texts(lines)) == ["one", "two", "3"]
    assert list(corpus.iter_texts(lines, limit=1)) == ["one"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(corpus.CorpusError, match="bad.jsonl:1"):
        list(corpus.iter_texts(tmp_path / "bad.jsonl"))
    with pytest.raises(corpus.CorpusError, match="not a file"):
        corpus.resolve(str(tmp_path / "missing.txt"))


def test_the_shipped_sharegpt_file_is_cut_off_and_still_read(tokenizer):
    path = corpus.sharegpt_path()
    assert path.read_bytes()[-200:].strip()[-1:] != b"]", "the shipped JSON is truncated"
    texts = list(corpus.iter_texts(path, limit=50))
    assert len(texts) > 50 and all(t.strip() for t in texts)


def test_cli_builds_a_datastore_from_a_jsonl_file(tmp_path, capsys):
    src = tmp_path / "corpus.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"The number {i} is followed by {i + 1}."})
                             for i in range(200)))
    out = tmp_path / "ds"
    argv = ["datastore", "build", "--corpus", str(src), "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "200 documents" in printed and "tokens" in printed and "MiB" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_documents"] == 200 and meta["model"] == "smollm2-135m"
    assert cli.main(argv) == 0 and "exists" in capsys.readouterr().out
    assert cli.main(["datastore", "info", "--datastore-path", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["num_documents"] == 200
    assert cli.main(["datastore", "build", "--corpus", str(tmp_path / "nope.txt")]) == 2
    assert "not a file" in capsys.readouterr().err


def test_a_datastore_of_another_tokenizer_is_refused(base_settings, small_datastore, tmp_path,
                                                     tokenizer):
    other = tmp_path / "other"
    shutil.copytree(small_datastore, other)
    meta = json.loads((other / "meta.json").read_text())
    meta.update(tokenizer="0123456789abcdef", model="qwen2.5-coder-0.5b")
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DatastoreMismatch, match="tokenizer family 0123456789abcdef"):
        build_engine(base_settings.with_overrides(**{"datastore.path": other}))

    class Remote:  # what the router sees of a datastore service of another family
        async def Info(self, request, timeout=None):
            return datastore_pb2.DatastoreInfo(name="x", tokenizer="0123456789abcdef")
    with pytest.raises(SystemExit, match="built with tokenizer family 0123456789abcdef"):
        asyncio.run(check_datastore(Remote(), tokenizer, 5.0))


def test_grpc_service_batched_lookup_lifecycle_and_errors(base_settings, small_datastore,
                                                          tokenizer, chat_prompt_ids):
    settings = base_settings.with_overrides(port=0, **{"datastore.path": small_datastore})

    async def run():
        server, port, cleanup = await start(settings)
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                stub = datastore_pb2_grpc.DatastoreStub(ch)
                info = await stub.Info(datastore_pb2.DatastoreInfoRequest())
                assert info.tokenizer == tokenizer_family(tokenizer)
                assert info.num_tokens > 100_000 and info.num_documents > 400
                prompts = [chat_prompt_ids(i) for i in range(3)]
                items = [datastore_pb2.LookupItem(request_id=f"r{i}", new_tokens=p, max_nodes=8,
                                                  max_depth=4, reset=True)
                         for i, p in enumerate(prompts)]
                reply = await stub.Lookup(datastore_pb2.LookupBatchRequest(items=items))
                assert len(reply.trees) == 3 and reply.lookup_seconds > 0
                for tree in reply.trees:
                    assert 0 < len(tree.tokens) <= 8
                    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
                    assert set(tree.source_names) <= {"datastore", "input"}
                # the next step sends only the accepted tokens
                step = datastore_pb2.LookupItem(request_id="r0", new_tokens=[reply.trees[0].tokens[0]],
                                                max_nodes=4, max_depth=2)
                reply = await stub.Lookup(datastore_pb2.LookupBatchRequest(items=[step]))
                assert len(reply.trees[0].tokens) <= 4
                assert (await stub.Info(datastore_pb2.DatastoreInfoRequest())).active_requests == 3
                errors = [
                    (datastore_pb2.LookupItem(request_id="unknown", new_tokens=[1], max_nodes=4,
                                              max_depth=2), grpc.StatusCode.FAILED_PRECONDITION,
                     "reset"),
                    (datastore_pb2.LookupItem(new_tokens=[1], max_nodes=4, max_depth=2),
                     grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
                    (datastore_pb2.LookupItem(request_id="r9", new_tokens=[1], max_nodes=10**6,
                                              max_depth=2, reset=True),
                     grpc.StatusCode.INVALID_ARGUMENT, "max_nodes"),
                    (datastore_pb2.LookupItem(request_id="r9", max_nodes=4, max_depth=2,
                                              reset=True),
                     grpc.StatusCode.INVALID_ARGUMENT, "whole context"),
                ]
                for item, code, message in errors:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Lookup(datastore_pb2.LookupBatchRequest(items=[item]))
                    assert err.value.code() == code and message in err.value.details()
                released = await stub.Release(datastore_pb2.DatastoreReleaseRequest(
                    request_ids=["r0", "r1", "r2", "nobody"]))
                assert released.released == 3
        finally:
            await server.stop(None)
            await cleanup()
    asyncio.run(run())


def test_datastore_only_greedy_equals_target_generate(base_settings, small_datastore, questions,
                                                      hf_greedy_reference, compute):
    settings = base_settings.with_overrides(**{
        "speculation.source": "datastore", "speculation.depth": 4,
        "speculation.max_nodes": 8, "datastore.path": small_datastore})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            assert mesh.drafter is None, "no draft model is loaded when only the datastore drafts"
            gate = asyncio.Semaphore(8)

            async def one(q):
                async with gate:
                    return await mesh.generate(
                        messages=[{"role": "user", "content": q["turns"][0]}],
                        max_tokens=MAX_TOKENS)
            outputs = await asyncio.gather(*(one(q) for q in questions[:NUM_QUESTIONS]))
            assert mesh.datastore.engine.requests == {}, "indexes dropped at completion"
            return outputs
    outputs = asyncio.run(run())
    assert_target_tokens(outputs, hf_greedy_reference)
    drafted = sum(o.stats.draft_tokens for o in outputs)
    accepted = sum(o.stats.accepted_tokens for o in outputs)
    print(f"datastore drafted {drafted}, accepted {accepted}")
    assert accepted > 0
