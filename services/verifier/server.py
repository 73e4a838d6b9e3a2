"""Verifier process: `specmesh serve verifier`."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from specmesh_services.common import metrics, models, pool as pool_mod, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.device import check as check_device
from specmesh_services.common.device import resolve_device
from specmesh_services.common.drafts import heads_spec, serves_heads
from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.lean import supports as lean_supports
from specmesh_services.common.lm import CausalLM
from specmesh_services.common.metrics import VerifierMetrics
from specmesh_services.common.rpc import start_server
from specmesh_kernels.backend import select_attention_backend
from specmesh_kernels.int4 import exact_int4
from specmesh_kernels.linear_rules import native_supports
from specmesh_services.verifier import ggml_engine
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.ggml_engine import GgmlLM
from specmesh_services.verifier.servicer import SERVICE_NAME, VerifierServicer
from specmesh_services.verifier.worker import VerifierWorker, default_name
from specmesh.v1 import verifier_pb2_grpc

log = logging.getLogger(__name__)


# auto serves native weights when at least this share of the linear weights is 4-bit
NATIVE_MIN_SHARE = 0.5


def served_weights(settings: Settings, path) -> str:
    """`target_weights`, with auto resolved: native where the dtype is left to auto, its kernels
    run (`native_supports`), at least NATIVE_MIN_SHARE of the linear weights are 4-bit lattice
    groups (GGUF Q4_0 / Q4_1 / Q4_K) and, with speculation on, the model's registry entry does
    not serve it float (`auto_weights`: float where its draft's trees pay only so; plain decoding
    is faster native); else the converted float weights (docs/decisions/target-weights.md)."""
    if settings.target_weights != "auto":
        return settings.target_weights
    if settings.dtype != "auto" or native_supports() is not None:
        return "float"
    source = models.REGISTRY.get(settings.model)
    if source is not None and source.auto_weights != "native" and settings.speculation.depth:
        return source.auto_weights
    return "native" if models.int4_share(path) >= NATIVE_MIN_SHARE else "float"


def served_runner(settings: Settings) -> str:
    """`target_runner`, auto resolved to ggml (llama.cpp's kernels on the model's GGUF file)
    where the dtype is left to auto, the device is the CPU, llama-cpp-python imports, nothing
    needs the torch target (exact, early pruning) and the model is a GGUF file or
    a known model whose registry entry measured ggml faster here (`auto_runner`: everywhere, or
    where llama.cpp's AMX kernels run; docs/decisions/ggml-target.md); else as given (auto: the
    lean decoder loop where the architecture allows)."""
    from specmesh_services.common.ggml_model import amx_kernels, available

    runner = settings.target_runner
    if runner != "auto" or settings.dtype != "auto" or settings.verifier.exact \
            or settings.verifier.prune != "off":
        return runner
    source = models.REGISTRY.get(settings.model)
    if source is None:
        wanted = models.is_gguf(Path(settings.model).expanduser())
    else:
        wanted = source.auto_runner == "ggml" or (source.auto_runner == "ggml-amx"
                                                  and amx_kernels())
    if not wanted or resolve_device(settings.device).type != "cpu" or available() is not None:
        return runner
    return "ggml"


def native_key(linear) -> bool:
    """Which layers a native target may fuse into one product: the 4-bit ones together, the
    others together (a fused product is int4 only when every part is). Judged on the first rows,
    as `int4_share` does: `native_int4` checks the fused weights in full afterwards, so the
    whole of a layer's weights is searched for its lattice once, not twice."""
    return exact_int4(linear.weight[:models.INT4_PROBE_ROWS])


def load_target(settings: Settings) -> CausalLM | LeanDecoder | GgmlLM:
    """The target as served: its converted weights in `dtype`, or its native 4-bit layers with
    float32 activations (`target_weights`), run by the lean decoder loop or transformers'
    forward, or its GGUF file by llama.cpp (`target_runner`); the output is lossless relative
    to these weights."""
    if served_runner(settings) == "ggml":
        settings = settings.with_overrides(target_runner="ggml")
    device = check_device(settings)
    if settings.target_runner == "ggml":
        lm = ggml_engine.load_target(settings)
        log.info("target %s on llama.cpp: %s, %d threads", settings.model, lm.model.path.name,
                 lm.model.threads)
        return lm
    path = models.resolve(settings.model, settings.cache_dir)
    weights = served_weights(settings, path) if device.type == "cpu" else "float"
    exact = settings.verifier.exact  # a row's bits independent of the rows beside it
    dtype = torch.float32 if weights == "native" else models.resolve_dtype(settings.dtype, device)
    runner = settings.target_runner
    if runner == "transformers":
        lm = CausalLM(models.load_model(path, dtype, linear=settings.linear, weights=weights,
                                        row_stable=exact, device=device), settings.model)
    else:
        model = models.load_model(path, dtype, linear="torch", device=device)
        reason = lean_supports(model)
        if reason is not None:
            if runner == "lean":
                raise ValueError(f"target_runner=lean: {reason}")
            models.convert_linears(model, settings.linear, weights, row_stable=exact)
            lm = CausalLM(model, settings.model)
        else:
            lm = LeanDecoder(model, settings.model,
                             prepare=lambda m: models.convert_linears(m, settings.linear, weights,
                                                                      row_stable=exact),
                             fuse_key=native_key if weights == "native" else None,
                             ops=settings.decoder_ops)
            del model
    log.info("target %s on %s: %d layers, %s, %s weights, %s forward", settings.model, device,
             lm.num_layers, dtype, weights,
             "lean" if isinstance(lm, LeanDecoder) else "transformers")
    return lm


def build_engine(target: CausalLM | LeanDecoder | GgmlLM, settings: Settings,
                 name: str) -> VerifierEngine:
    """The verifier engine as `settings.verifier` configures it (KV budget, batch, backend)."""
    v = settings.verifier
    limits = EngineLimits(kv_budget_tokens=v.kv_budget_tokens, block_size=v.kv_block_size,
                          max_batch_tokens=v.max_batch_tokens, max_batch_trees=v.batch_size,
                          graph_rows=v.cuda_graph_rows, run_lookup=v.run_lookup,
                          run_lookup_tokens=v.run_lookup_tokens, run_heads=v.run_heads,
                          run_ahead=v.run_ahead)
    if isinstance(target, GgmlLM):  # what it cannot serve was refused by check_device
        log.info("verifier %s on llama.cpp: %d KV cells, batch %d trees / %d rows", name,
                 v.kv_budget_tokens, v.batch_size, v.max_batch_tokens)
        engine = ggml_engine.GgmlEngine(target, name, limits)
    else:
        backend = select_attention_backend(target.device, v.attention, v.exact)
        engine = VerifierEngine(target, name, limits, backend)
    if serves_heads(settings):
        from specmesh_services.heads.draft import load_for_target

        if not isinstance(target, (LeanDecoder, GgmlLM)):
            raise ValueError("draft heads need the lean target forward or llama.cpp's "
                             "(target_runner=lean or ggml): they return the final hidden "
                             "states the heads read")
        engine.heads = load_for_target(settings, heads_spec(settings))
        log.info("draft heads %s: %d heads over %d tokens, %s weights", heads_spec(settings),
                 engine.heads.depth, engine.heads.vocab.numel(), engine.heads.weights)
    if isinstance(target, GgmlLM):
        return engine
    if v.prune != "off":
        if not isinstance(target, LeanDecoder):
            raise ValueError("early pruning needs the lean target forward (target_runner=lean)")
        engine.target.pruner = load_pruner(settings)
        log.info("early pruning after layer %d, Top-%d (%s weights)", engine.target.pruner.layer,
                 v.prune_top_k, engine.target.pruner.weights)
    seconds = engine.capture_graphs()  # after the pruner: a pruned step runs eagerly
    if seconds:
        graphs = engine.target.graphs
        log.info("verify step: %d CUDA graphs captured (buckets up to %d rows) in %.1f s",
                 graphs.captured, graphs.max_rows, seconds)
    log.info("verifier %s: KV budget %d rows (%.0f MiB), batch %d trees / %d rows, attention %s",
             name, engine.store.capacity,
             engine.store.capacity * engine.store.bytes_per_token() / 2**20, v.batch_size,
             v.max_batch_tokens, backend.name)
    return engine


def load_pruner(settings: Settings):
    """The early pruner `settings.verifier` names, over the target's LM head and final norm in
    this machine's fast dtype."""
    from specmesh_services.common.datastore_files import tokenizer_family
    from specmesh_services.heads import early
    from specmesh_services.verifier.prune import EarlyPruner

    v = settings.verifier
    folder = (early.default_folder(settings, settings.model, v.prune_layer) if v.prune == "on"
              else Path(v.prune))
    if folder is None:
        raise FileNotFoundError(f"no early head for {settings.model}"
                                f"{'' if v.prune_layer is None else f' at layer {v.prune_layer}'}"
                                f": train one with `specmesh heads early --model {settings.model}`")
    path = models.resolve(settings.model, settings.cache_dir)
    device = check_device(settings)
    model = models.load_model(path, models.resolve_dtype(settings.dtype, device), linear="torch",
                              device=device)
    head = early.load(folder, settings.model, tokenizer_family(models.load_tokenizer(path)),
                      model.get_output_embeddings().weight.detach(),
                      model.model.norm.weight.detach(), model.config.rms_norm_eps)
    if head.layer >= model.config.num_hidden_layers:
        raise ValueError(f"early head of layer {head.layer}: the target has "
                         f"{model.config.num_hidden_layers} layers")
    return EarlyPruner(head, v.prune_top_k)


async def start(settings: Settings):
    if not settings.redis_url:
        raise SystemExit("the verifier service needs the pool: set --redis-url / SPECMESH_REDIS_URL")
    executor = serving.compute_executor(settings, "verifier")
    lm = await asyncio.get_running_loop().run_in_executor(executor, load_target, settings)
    pool = pool_mod.connect(settings.redis_url, settings.pool_prefix)
    engine = await asyncio.get_running_loop().run_in_executor(  # CUDA graphs captured there
        executor, build_engine, lm, settings, settings.verifier.name or default_name())
    worker = VerifierWorker(engine, pool, executor, settings.verifier,
                            VerifierMetrics(metrics.process_registry(), settings.model))
    worker.start()
    server, port = await start_server(
        [(verifier_pb2_grpc.add_VerifierServicer_to_server,
          VerifierServicer(worker, settings.model), SERVICE_NAME)],
        settings.host, settings.port, settings.tls)

    async def cleanup() -> None:
        await worker.drain(settings.drain_s)
        await pool.close()
        executor.shutdown(wait=False, cancel_futures=True)
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("verifier", settings, start)
