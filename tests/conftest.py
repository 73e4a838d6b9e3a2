"""Shared fixtures.

- A private redis-server for the session (never the system one on 6379), flushed before every
  test that asks for `redis_url`.
- The smallest real model (SmolLM2-135M-Instruct) in float32 for exact identity, its tokenizer,
  MT-Bench prompts, and the target's own greedy outputs as the reference. Converted weights are
  cached in ~/.cache/specmesh (SPECMESH_CACHE_DIR) across runs.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
if not os.environ.get("CUDA_VISIBLE_DEVICES") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU here: Triton kernels run in its interpreter

import pytest
import redis
import torch

from specmesh_services.common.prompts import mtbench_questions
from specmesh_services.common import models, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.lm import CausalLM
from specmesh_services.launch.redis_server import RedisServer

# A test process per core (pytest -n 2 on two cores): torch in each on one thread, as two
# processes' two-thread OpenMP teams spin at barriers on the cores the other one holds. Services
# started as processes get their threads from the stack's core plan, as in serving.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= len(os.sched_getaffinity(0)):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


# ---------------------------------------------------------------------------------------------
# the real model
MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    """Settings of the test meshes: the default model in float32, a tree drafted by the draft
    model every step (the model's own default source is the datastore; fixed size: the adaptive
    default may decode plainly where trees do not pay, and the lossless tests are about trees;
    tests of the adaptive sizing and of the datastore ask for them)."""
    return Settings(model=MODEL, dtype="float32",
                    speculation={"tree_size": "fixed", "source": "model"})


@pytest.fixture(scope="session")
def target_path(base_settings):
    """The default model's converted weights: from its package, or from the GGUF that
    TEST_SMOLLM2_GGUF names (a machine without the package: bench/device.sh sets it)."""
    gguf = os.environ.get("TEST_SMOLLM2_GGUF")
    if gguf:
        return models.prepare(MODEL, base_settings.cache_dir, progress=False, gguf=Path(gguf))
    return models.resolve(MODEL, base_settings.cache_dir)


@pytest.fixture(scope="session")
def tokenizer(target_path):
    return models.load_tokenizer(target_path)


@pytest.fixture(scope="session")
def hf_target(target_path):
    """The target as a plain transformers model (the reference)."""
    return models.load_model(target_path, torch.float32)


@pytest.fixture(scope="session")
def target_lm(hf_target):
    return CausalLM(hf_target, MODEL)


@pytest.fixture(scope="session")
def questions():
    return mtbench_questions()


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer, questions):
    """chat_prompt_ids(i): token ids of MT-Bench question i (first turn) in the chat template."""
    def ids(i: int) -> list[int]:
        messages = [{"role": "user", "content": questions[i]["turns"][0]}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return ids


@pytest.fixture(scope="session")
def compute():
    """One thread for the heavy torch work of the test process (references, embedded meshes):
    every thread running torch ops gets its own OpenMP team, and teams compete for the cores."""
    executor = serving.compute_executor()
    yield executor
    executor.shutdown(wait=True)


@contextlib.contextmanager
def once_per_run(tmp_path_factory, name: str, wait: bool = True):
    """A path shared by the run's test processes (pytest-xdist workers) and whether it still has
    to be made: the first process to get here makes it while the others wait (a file lock), or,
    with `wait=False`, raise filelock.Timeout at once."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's temporary folder, above each worker's own
    path = root / name
    with FileLock(str(path) + ".lock", timeout=-1 if wait else 0):
        yield path, not path.exists()


REFERENCES = 20


@pytest.fixture(scope="session")
def hf_greedy_reference(hf_target, tokenizer, chat_prompt_ids, compute, tmp_path_factory):
    """The target's own greedy continuations (64 new tokens) of the first 20 MT-Bench questions.
    The run's test processes share the work: each makes the continuations no other is making,
    then waits for the rest. One torch thread each: a one-row `generate` is mostly Python (as
    fast on one thread as on two), and two processes' two-thread OpenMP teams on two cores spin
    at barriers (3x slower each)."""
    from filelock import Timeout

    def generate(i: int) -> list[int]:
        ids, threads = torch.tensor([chat_prompt_ids(i)]), torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                seq = hf_target.generate(ids, attention_mask=torch.ones_like(ids),
                                         do_sample=False, max_new_tokens=64,
                                         pad_token_id=tokenizer.eos_token_id)
        finally:
            torch.set_num_threads(threads)
        return seq[0, ids.shape[1]:].tolist()
    made: dict[int, list[int]] = {}
    for wait in (False, True):
        for i in sorted(set(range(REFERENCES)) - set(made)):
            try:
                with once_per_run(tmp_path_factory, f"hf-greedy-reference-{i}.json", wait) as (
                        path, make):
                    if make:
                        path.write_text(json.dumps(compute.submit(generate, i).result()))
                    made[i] = json.loads(path.read_text())
            except Timeout:
                continue  # another process is making it: taken on the waiting pass
    return [made[i] for i in range(REFERENCES)]


@pytest.fixture(scope="session")
def small_datastore(base_settings, tokenizer, tmp_path_factory):
    """A lookup datastore of the first 400 ShareGPT conversations, tokenized with the default
    model's tokenizer (the full one takes minutes to build; lossless checks need no quality)."""
    from specmesh_services.datastore.build import build

    with once_per_run(tmp_path_factory, "small-datastore") as (folder, make):
        if make:
            folder.mkdir()
            path, _ = build(base_settings, "sharegpt", folder / "ds", limit=400, progress=False,
                            tokenizer=tokenizer)
            (folder / "path").write_text(str(path))
        return Path((folder / "path").read_text())


@pytest.fixture(scope="session")
def gguf():
    """The default model's GGUF file, for llama.cpp's backend (skipped where
    llama-cpp-python is not installed)."""
    from specmesh_services.common.ggml_model import available

    if (why := available()) is not None:
        pytest.skip(why)
    return models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0]
