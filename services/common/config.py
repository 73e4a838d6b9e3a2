"""Typed configuration of every specmesh process, in one place.

Values come from (highest first) CLI flags, environment variables `SPECMESH_*` (nested sections
with `__`, e.g. `SPECMESH_SPECULATION__DEPTH=6`), a YAML file (`--config FILE`, nested sections
as mappings), then the defaults below, which work out of the box: the default target model and
its default draft, greedy chains of up to 8 tokens that stop where the draft is unsure, sized per
request and step. A key or `SPECMESH_*` variable that names no field is an error naming the
nearest valid one. docs/configuration.md lists every setting (`specmesh config reference`).
"""
from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (BaseSettings, EnvSettingsSource, NoDecode,
                               PydanticBaseSettingsSource, SettingsConfigDict)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GATEWAY_PORT = 50051
DEFAULT_HTTP_PORT = 8000
ENV_PREFIX = "SPECMESH_"


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # the device setting's values
# overrides for decoding without speculation: no draft trees, no prompt lookup or heads in runs
# (the baseline every benchmark's "plain" row measures)
PLAIN_DECODING = {"speculation.depth": 0, "verifier.run_lookup": 0, "verifier.run_heads": 0}


class SettingsError(ValueError):
    """A setting that names no field, or a value it cannot take: one line, meant for the user."""


class Section(BaseModel):
    """A nested settings section; a key that names none of its fields is an error, not dropped."""

    model_config = ConfigDict(extra="forbid")


class SpeculationSettings(Section):
    """What the router asks the draft sources for: the tree shape, and how its size is chosen."""

    # 8: long chains pay once the confidence stop below cuts them short
    # (docs/decisions/serving-defaults.md)
    depth: int = Field(8, ge=0, le=64, description="draft tokens per path (0 = plain decoding)")
    width: int = Field(1, ge=1, le=64, description="nodes kept per depth level (1 = chain)")
    # one pool round trip costs about a small model's forward (docs/decisions/plain-runs.md)
    plain_tokens: int = Field(4, ge=1, le=64, description="a plain step (an empty tree: depth 0, "
                              "or speculation not paying for the request) decodes up to this "
                              "many tokens one after another in the verifier, answering once "
                              "(1 = one token a round trip)")
    # bounded by time: 1.02-1.07x fixed runs of 4 on SmolLM2 (docs/decisions/plain-runs.md)
    plain_run_seconds: float = Field(0.06, ge=0, description="a plain run goes on past "
                                     "plain_tokens while its tokens, at the request's measured "
                                     "seconds a plain token, fit in this long (a run's tokens "
                                     "reach the client together); 0 = plain_tokens exactly")
    min_probability: float = Field(
        0.6, ge=0, lt=1, description="draft models stop below the first level whose likeliest "
                                     "node they give less than this probability (HF assisted "
                                     "generation's confidence threshold; 0 = full depth)")
    source: Literal["auto", "model", "datastore", "both"] = Field(
        "auto", description="who drafts: the draft model(s) and heads, the lookup datastore "
                            "(SSSD), or both merged into one tree; auto = the drafts when "
                            "`drafters` are given, else the model's registry entry (SmolLM2: "
                            "datastore, no draft pays against it; the Qwen models: model; a "
                            "local model directory: model)")
    max_nodes: int = Field(8, ge=1, le=256, description="node budget of a datastore tree (and of "
                                                         "a merged tree)")
    tree_size: Literal["fixed", "adaptive", "length"] = Field(
        "adaptive", description="fixed: every step drafts the configured tree; adaptive: per request "
                             "and step, the node budget with the most expected tokens per second "
                             "(ProPD: measured step times, per-request acceptance), 0 = plain "
                             "decoding when speculation cannot pay; length: Minions' adaptive "
                             "speculation length (slope of step time / verified length)")
    probe_every: int = Field(16, ge=0, description="adaptive: every N steps one step at a "
                                                   "neighbouring size keeps the cost model fresh "
                                                   "(0 = never)")
    selection: Literal["fixed", "lbss", "greedy", "epsilon-greedy"] = Field(
        "fixed", description="which source drafts for which request: fixed = the `source` "
                             "setting for every request; lbss = SPIN's bandit over the datastore "
                             "and each draft model (learnt goodput, capacities); greedy = by "
                             "prompt length; epsilon-greedy (SPIN's baselines)")
    slot_s: float = Field(1.0, gt=0, description="selection: seconds per time slot (plans are "
                                                 "kept for a slot)")
    drafter_capacity: int = Field(8, ge=1, description="selection: requests a draft model "
                                                       "serves at once")
    epsilon: float = Field(0.2, ge=0, le=1, description="epsilon-greedy: share of slots in "
                                                        "which all requests take the best source")
    prespeculate: bool = Field(False, description="pre-speculation: while a step's tree is "
                               "verified, its draft model drafts the next tree under 'the whole "
                               "main path accepted'; used when that came true (one draft model "
                               "alone drafting, no datastore or vote)")
    coupled: bool = Field(True, description="sampled requests: the draft models draw with the "
                          "target's own random numbers (coupled drafting), so the target's draw "
                          "equals the drafted token whenever the two agree; off: they draft their "
                          "likeliest tokens (the output is the same either way)")
    voting: bool = Field(False, description="majority vote (Minions): every source drafts each "
                                            "step, their paths are merged by weighted vote and "
                                            "the voted path is verified (selection=fixed only)")
    vote_union_extra_s: float = Field(0.0, ge=0, description="voting: verify every source's path "
                                      "(the union) when its extra nodes cost at most this many "
                                      "seconds by the measured step-cost slope (0 = voted path "
                                      "only, as Minions)")


class DatastoreSettings(Section):
    """The lookup datastore service (SSSD): a suffix array over a corpus + per-request indexes."""

    path: Path | None = Field(None, description="datastore directory (`specmesh datastore build`); "
                                                "default: the ShareGPT store of the target's "
                                                "tokenizer under <cache_dir>/datastores")
    prefix_len: int = Field(4, ge=1, le=16, description="longest context suffix matched (P)")
    max_conts: int = Field(100, ge=1, description="continuations sampled per match (M), at "
                                                  "regular intervals of the suffix-array range")
    min_conts: int = Field(20, ge=1, description="keep matching shorter prefixes while fewer "
                                                 "continuations than this were found")
    index_ttl_s: float = Field(600.0, gt=0, description="drop a request's prompt/output index "
                                                        "after this long without a lookup")


class GatewaySettings(Section):
    """The gateway's OpenAI-compatible HTTP API (beside its gRPC API on `port`) and the keys
    both APIs require."""

    http_port: int | None = Field(DEFAULT_HTTP_PORT, ge=0, le=65535, description="port of the "
                                  "OpenAI-compatible HTTP API (/v1/completions, "
                                  "/v1/chat/completions, /v1/models, /health); 0 = any free "
                                  "port, null = no HTTP")
    api_keys: SecretStr | None = Field(None, description="keys clients must send (comma-"
                                       "separated; gRPC metadata or HTTP header `authorization: "
                                       "Bearer <key>`); never logged or shown. Unset and no "
                                       "api_keys_file: no key needed")
    api_keys_file: Path | None = Field(None, description="a file of accepted keys, one per line "
                                       "(# comments), read at start")
    resume_s: float = Field(30.0, gt=0, description="how long a stream whose router died is "
                            "retried on the routers (going on from the request's state in the "
                            "pool, after the last token sent) before its client gets the error")


class TlsSettings(Section):
    """TLS of every gRPC server and client of the mesh, and of the gateway's HTTP API."""

    cert_file: Path | None = Field(None, description="this service's certificate chain (PEM); "
                                   "set: TLS on")
    key_file: Path | None = Field(None, description="its private key (PEM)")
    ca_file: Path | None = Field(None, description="the CA that signed the services' "
                                 "certificates: clients verify servers with it (and servers "
                                 "clients, with mutual)")
    mutual: bool = Field(False, description="servers require a client certificate signed by "
                         "ca_file; clients present cert_file")

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class TelemetrySettings(Section):
    """OpenTelemetry export; off unless an OTLP endpoint or the console exporter is set."""

    otlp_endpoint: str | None = Field(None, description="OTLP/gRPC collector, e.g. localhost:4317")
    console: bool = Field(False, description="print finished spans to stderr (debugging)")


class VerifierSettings(Section):
    """The verifier service: continuous batching of draft trees, KV memory, metrics."""

    batch_size: int = Field(8, ge=1, description="trees verified together in one forward pass")
    max_batch_tokens: int = Field(1024, ge=1, description="new rows per forward pass (trees + "
                                  "prefill chunks); long prompts are prefilled in chunks")
    kv_budget_tokens: int = Field(16384, ge=16, description="KV rows held for all requests; when "
                                  "full, idle requests are evicted and re-prefilled later")
    kv_block_size: int = Field(16, ge=1, description="KV allocation unit (rows)")
    attention: Literal["auto", "torch", "triton", "flash-attn"] = Field(
        "auto", description="attention backend: auto = flash-attn/Triton on CUDA, torch on CPU")
    exact: bool = Field(False, description="compute every row of a verify pass independently "
                        "of the rows beside it: speculative output bit-identical to plain "
                        "decoding of the served target in every dtype (one-row linear calls as "
                        "two, attention of plain steps and trees in float64 on the torch "
                        "backend; slower: docs/decisions/cpu-tree-attention.md). Off: in bf16 "
                        "and native int4 an output can differ from plain decoding at near-tied "
                        "logits")
    cuda_graph_rows: int = Field(512, ge=0, description="on CUDA with the lean target: a verify "
                                 "step of up to this many rows, none of them a prefill chunk, "
                                 "is padded to a bucket of rows (powers of two) and replayed "
                                 "from a CUDA graph captured at start-up; 0 = every step eager")
    prune: str = Field("off", description="early pruning of tree nodes (ProPD 4.1): after the "
                       "early head's layer, nodes whose token is not in their parent's Top-k "
                       "skip the remaining layers; off, on (the model's early head: `specmesh "
                       "heads early`, cached or shipped), or an early head's folder")
    prune_top_k: int = Field(50, ge=1, description="early pruning: a node survives when its "
                             "token is among its parent's k likeliest by the early head")
    prune_layer: int | None = Field(None, ge=1, description="early pruning with prune=on: the "
                                    "cached early head of this layer (default: the lowest)")
    run_lookup: int = Field(3, ge=0, description="prompt lookup in plain runs: where a "
                            "request's last n tokens occurred before in its prompt or output, "
                            "the tokens that followed are verified as a chain in the run's next "
                            "forward (llama.cpp's ngram-simple); n, 0 = off")
    run_lookup_tokens: int = Field(5, ge=1, description="prompt lookup in plain runs: tokens "
                                   "drafted a lookup at most")
    run_heads: int = Field(16, ge=0, le=64, description="draft heads in plain runs: where the "
                           "verifier serves heads, a round may verify their tree of this many "
                           "nodes below a request's next token, when its measured tokens a "
                           "second say it pays (a GPU); 0 = off")
    run_ahead: int = Field(0, ge=0, le=64, description="on CUDA, where the verify step "
                           "replays graphs: a plain run's round with no lookup chain and no "
                           "heads tree decodes this many tokens back to back, each step's draw "
                           "fed to the next on the device and copied to the host once for all "
                           "(vLLM's multi-step decoding; not with repetition, presence or "
                           "frequency penalties); 0 or 1 = a host sync every token")
    claim_idle_s: float = Field(30.0, gt=0, description="re-claim drafts unacknowledged this long")
    max_deliveries: int = Field(5, ge=1, description="a draft delivered this many times without "
                                "being verified (every verifier that took it died or failed on "
                                "it) goes to the dead-letter stream, its request fails with the "
                                "reason logged")
    batch_wait_s: float | None = Field(
        None, ge=0, description="with fewer trees in hand than requests it is serving, wait this "
        "long for the others' trees to fill the batch (default: measured, only for trees due "
        "within a step's fixed cost; 0 = never wait)")
    name: str = Field("", description="consumer name in the pool (default: verifier-<pid>)")


class RouterSettings(Section):
    """The router service: per-request steps, back-pressure, micro-batching of draft calls."""

    step_timeout_s: float = Field(120.0, gt=0, description="give up on a step after this long")
    resubmit_s: float = Field(5.0, gt=0, description="a step with no result this long whose tree "
                              "is gone from the pool (lost with a Redis restart) is submitted "
                              "again; duplicates are harmless (a stale tree is only "
                              "acknowledged)")
    request_ttl_s: float = Field(3600.0, gt=0, description="pool state expiry of abandoned requests")
    max_requests: int = Field(64, ge=1, description="admission: requests one router generates "
                              "at once; more wait for a slot")
    max_waiting: int = Field(256, ge=0, description="admission: requests waiting for a slot at "
                             "most; beyond, a new request is refused at once with "
                             "RESOURCE_EXHAUSTED (HTTP 429)")
    admission_wait_s: float = Field(60.0, gt=0, description="admission: how long a request "
                                    "waits for a slot (less when its client's deadline is "
                                    "nearer) before it is refused with RESOURCE_EXHAUSTED")
    max_pending_trees: int | None = Field(
        None, ge=0, description="back-pressure: pause drafting while this many trees wait in the "
        "pool (default: as many as the verifiers that answered lately batch together, their "
        "batch sizes summed; 0 = never)")
    draft_batch_max: int = Field(64, ge=1, description="micro-batching: most Draft/Lookup items "
                                                       "sent in one call")
    micro_batches: int | None = Field(
        None, ge=1, description="draft items ready together go out in this many calls in turn "
        "(SPIN's micro-batch pipeline), so the verifier starts on the first while the drafter "
        "drafts the next; default: SPIN's heuristic over the measured verify cost where the "
        "drafters have cores of their own (cores=split), else 1")


class Settings(BaseSettings):
    """Everything a specmesh process can be told. Each role reads the parts it needs."""

    model_config = SettingsConfigDict(env_prefix="SPECMESH_", env_nested_delimiter="__",
                                      extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="target model: a known name "
                       "(`specmesh models list`), a local Hugging Face directory, a GGUF file "
                       "(PATH.gguf: tokenizer and chat template from the file), or a Hugging "
                       "Face Hub id (owner/name[@revision], fetched through the Hub cache; "
                       "HF_HUB_OFFLINE=1: the cached snapshot only)")
    device: str = Field("auto",
                        description="where the models and their caches run: auto (the first GPU "
                                    "torch sees, else the CPU), cpu, cuda or cuda:N; the "
                                    "datastore stays on the CPU")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="target/draft dtype; auto = bfloat16 on CUDA and where the CPU runs "
                            "it fast")
    linear: Literal["auto", "torch", "onednn", "fp16"] = Field(
        "auto", description="CPU kernels of the models' linear layers: onednn = weights packed once "
                            "(cost nearly flat in the rows of a verify step); fp16 = bf16 weights "
                            "stored as float16 for FBGEMM (CPUs without bf16 arithmetic); auto = "
                            "onednn where the CPU runs the dtype, else fp16 for bf16, else torch")
    decoder_ops: Literal["auto", "torch", "triton"] = Field(
        "auto", description="the lean forward's elementwise steps (residual add + RMSNorm, RoPE, "
                            "SiLU x up): triton = one fused kernel each (under half a layer's "
                            "launches; CUDA only), torch = torch's ops; auto = triton on CUDA, "
                            "torch on the CPU (docs/decisions/fused-decoder-ops.md)")
    target_weights: Literal["auto", "float", "native"] = Field(
        "auto", description="the target's weights as served: float = the converted weights in "
                            "`dtype`; native = the layers the GGUF stores as 4-bit blocks keep "
                            "their codes and run through torch's CPU int4 kernel, the others "
                            "(6- and 8-bit blocks) in bf16, activations in float32; auto = "
                            "native where dtype is auto, most linear weights are 4-bit and "
                            "the model's registry entry does not prefer float weights while "
                            "speculating (docs/decisions/target-weights.md), else float. "
                            "Lossless relative to the weights as served")
    drafters: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="draft models: 'layers:N' (first N layers of the target) or a model name, "
                    "directory or Hub id, optionally '@int8' or '@int4' (quantized weights: "
                    "about half the drafting time on a CPU, the output unchanged); empty = the "
                    "target's default draft")
    draft_vocab: int = Field(0, ge=0, description="draft models' LM heads over the N most "
                             "frequent tokens of the datastore's corpus (FR-Spec: a cheaper "
                             "drafting forward, the output unchanged); 0 = the whole vocabulary")
    draft_runner: Literal["auto", "lean", "transformers", "ggml"] = Field(
        "auto", description="draft models' forward: lean = specmesh's decoder loop for Llama / "
                            "Qwen2 drafts (fused products, preallocated KV rows, logits over the "
                            "draft vocabulary only: services/drafter/lean.py); transformers = the "
                            "model's own forward; ggml = llama.cpp's kernels on the draft's GGUF "
                            "file (draft models, not layers:N; CPU only; "
                            "services/drafter/ggml_lm.py); auto = lean where the architecture "
                            "allows")
    draft_graph_rows: int = Field(
        256, ge=0, description="on CUDA with the lean draft runner: draft models keep their rows "
                               "in a paged store (twice verifier.kv_budget_tokens) and a "
                               "drafting forward of up to this many rows (64 at least: a tree "
                               "level's most) is padded to a bucket and replayed from a CUDA "
                               "graph captured at start-up (services/drafter/paged.py); 0 = "
                               "eager over per-request buffers")
    target_runner: Literal["auto", "lean", "transformers", "ggml"] = Field(
        "auto", description="the target's forward: lean = specmesh's decoder loop for Llama / "
                            "Qwen2 targets over the paged KV store (fused products, no "
                            "transformers modules: services/common/lean.py); transformers = the "
                            "model's own forward with specmesh's attention function; ggml = "
                            "llama.cpp's kernels on the model's GGUF file as it is stored "
                            "(CPU only; needs llama-cpp-python: `pip install 'specmesh[ggml]'`; "
                            "no early pruning; docs/decisions/ggml-target.md); "
                            "auto = ggml on the CPU for a GGUF file, SmolLM2 and "
                            "Qwen2.5-Coder-1.5B where llama-cpp-python is installed, the dtype is "
                            "auto and "
                            "nothing needs the torch target, else lean where the architecture "
                            "allows")
    cores: Literal["auto", "shared", "split"] = Field(
        "auto", description="CPU cores of the compute roles (`specmesh up`, `serve`, `run`): "
                            "shared = verifier and drafters take turns on every core; split = "
                            "the drafters (and datastore) get `drafter_cores` of their own so "
                            "drafting runs beside verification; auto = the faster one measured "
                            "for this host kind (docs/decisions/core-placement.md)")
    drafter_cores: int = Field(0, ge=0, description="cores=split: cores of the drafting roles "
                                                    "(0 = a third of the cores, at least one)")
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    cache_dir: Path = Field(Path.home() / ".cache" / "specmesh", description="converted weights")
    run_dir: Path | None = Field(None, description="state and logs of `specmesh up` "
                                                   "[<cache_dir>/run]")
    redis_url: str | None = Field(None, description="Redis of the pool (multi-process mode; "
                                                  "`specmesh up` starts its own when unset)")
    pool_prefix: str = Field("specmesh", description="key prefix of the pool in Redis")
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request gives none")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens accepted")
    host: str = Field("127.0.0.1", description="interface services listen on")
    port: int = Field(0, ge=0, le=65535, description="port of this service (0 = any free port)")
    drain_s: float = Field(20.0, ge=0, description="on SIGTERM: report NOT_SERVING, take no new "
                           "work and finish what is in flight for at most this long, then exit "
                           "(keep it under Kubernetes' terminationGracePeriodSeconds)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve this process's "
                                     "Prometheus metrics at http://host:PORT/metrics (0 = any "
                                     "free port; docs/metrics.md lists them)")
    router_address: str = Field("127.0.0.1:50052", description="gateway -> router; comma-"
                                "separated replicas: new requests go round-robin, a stream "
                                "whose router dies resumes on another")
    drafter_address: str = Field("127.0.0.1:50053", description="router -> drafter; comma-"
                                 "separated replicas: each request sticks to one, moving when "
                                 "it dies")
    datastore_address: str = Field("127.0.0.1:50055", description="router -> datastore; comma-"
                                   "separated replicas, as drafter_address")
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    datastore: DatastoreSettings = Field(default_factory=DatastoreSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    log_level: str = Field("INFO", description="logging level: DEBUG, INFO, WARNING, ...")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if DEVICE_PATTERN.fullmatch(value) is None:
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return value

    @field_validator("draft_graph_rows")
    @classmethod
    def _draft_bucket(cls, value: int) -> int:
        if 0 < value < 64:
            raise ValueError("expected 0 (off) or at least 64 (the most rows of a tree level)")
        return value

    @field_validator("drafters", mode="before")
    @classmethod
    def _split_drafters(cls, value: Any) -> Any:
        # '["layers:8"]' (JSON) or "layers:8,qwen2.5-coder-0.5b" from an env var
        if isinstance(value, str):
            if value.strip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def stack_dir(self) -> Path:
        return self.run_dir or self.cache_dir / "run"

    def with_overrides(self, **overrides: Any) -> "Settings":
        """A copy with the given (non-None) fields replaced; nested sections as dicts or dotted
        keys. A key that names no field is a SettingsError naming the nearest one."""
        given = {key: value for key, value in overrides.items() if value is not None}
        check_keys(given)
        return validate(deep_merge(self.model_dump(), nest(given)))

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Every Settings() read from the environment first refuses mistyped SPECMESH_* names."""
        check_environment(os.environ)
        return init_settings, env_settings, dotenv_settings, file_secret_settings


# ---------------------------------------------------------------------------------------------
# keys, variables and files: one check, errors that name the nearest valid setting


def section_of(field: FieldInfo) -> type[Section] | None:
    """The section model a field holds (`speculation` -> SpeculationSettings), else None."""
    kind = field.annotation
    return kind if isinstance(kind, type) and issubclass(kind, Section) else None


def setting_fields(model: type[BaseModel] = Settings,
                   prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf setting as (dotted key, field), sections expanded, in declaration order."""
    for name, field in model.model_fields.items():
        section = section_of(field)
        if section is None:
            yield prefix + name, field
        else:
            yield from setting_fields(section, f"{prefix}{name}.")


def setting_keys() -> list[str]:
    """Every valid dotted key: the leaves and the section names (a whole section is settable)."""
    sections = [name for name, field in Settings.model_fields.items() if section_of(field)]
    return [key for key, _ in setting_fields()] + sections


def env_name(key: str) -> str:
    """The variable of a dotted key: speculation.depth -> SPECMESH_SPECULATION__DEPTH."""
    return ENV_PREFIX + key.replace(".", "__").upper()


def nearest_key(name: str) -> str | None:
    """The valid dotted key closest to `name` by spelling; a section's field named without its
    section (`depth`) also finds it (`speculation.depth`)."""
    keys = setting_keys()
    candidates = {key.rpartition(".")[2]: key for key in keys if "." in key}
    candidates.update({key: key for key in keys})
    match = difflib.get_close_matches(name.lower(), candidates, n=1)
    return candidates[match[0]] if match else None


def unknown(name: str, nearest: str | None) -> SettingsError:
    """The one error for a setting that does not exist."""
    hint = f"did you mean {nearest}?" if nearest else "every setting is in docs/configuration.md"
    return SettingsError(f"unknown setting {name}: {hint}")


def check_keys(data: Mapping[str, Any], model: type[BaseModel] = Settings,
               prefix: str = "") -> None:
    """Raise SettingsError for a key (dotted `speculation.depth` or nested mappings, at any level)
    that names no field: pydantic would refuse it too, but without the nearest valid name."""
    for key, value in data.items():
        head, _, rest = str(key).partition(".")
        field = model.model_fields.get(head)
        section = section_of(field) if field is not None else None
        if field is None or (rest and section is None):
            raise unknown(prefix + str(key), nearest_key(prefix + str(key)))
        if section is not None and rest:
            check_keys({rest: value}, section, f"{prefix}{head}.")
        elif section is not None and isinstance(value, Mapping):
            check_keys(value, section, f"{prefix}{head}.")


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise SettingsError for a SPECMESH_* variable that names no setting (pydantic-settings
    would ignore it silently). Names are case-insensitive, as pydantic-settings reads them."""
    valid = {env_name(key) for key in setting_keys()}
    for var in sorted(environ):
        upper = var.upper()
        if upper.startswith(ENV_PREFIX) and upper not in valid:
            guess = nearest_key(upper.removeprefix(ENV_PREFIX).lower().replace("__", "."))
            raise unknown(var, env_name(guess) if guess else None)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML settings file (nested sections as mappings) as a dict, its keys checked."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise SettingsError(f"cannot read config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SettingsError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    try:
        check_keys(data)
    except SettingsError as err:
        raise SettingsError(f"{path}: {err}") from None
    return data


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys as nested dicts: {"speculation.depth": 4} -> {"speculation": {"depth": 4}}."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return out


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, sections merged key by key rather than replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def validate(data: Mapping[str, Any]) -> Settings:
    """Settings from plain data (no environment read), a bad value as a one-line SettingsError."""
    try:
        return Settings.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                             for e in err.errors())
        raise SettingsError(f"invalid setting {problems}") from None


def load_settings(flags: Mapping[str, Any] | None = None,
                  config_file: str | Path | None = None) -> Settings:
    """The settings of a command: `flags` (dotted keys, None = not given) over the SPECMESH_*
    environment over the YAML `config_file` over the defaults; every unknown name refused."""
    check_environment(os.environ)
    data = read_config_file(config_file) if config_file else {}
    data = deep_merge(data, EnvSettingsSource(Settings)())
    given = {key: value for key, value in (flags or {}).items() if value is not None}
    check_keys(given)
    return validate(deep_merge(data, nest(given)))
