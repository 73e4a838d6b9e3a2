"""Typed configuration of every specmesh process, in one place.

Values come from (highest first) CLI flags, environment variables `SPECMESH_*` (nested sections
with `__`, e.g. `SPECMESH_SPECULATION__DEPTH=6`), then the defaults below, which work out of the
box: the default target model and its default draft, greedy chains of up to 8 tokens that stop
where the draft is unsure, sized per request and step.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_GATEWAY_PORT = 50051


class SpeculationSettings(BaseModel):
    """What the router asks the draft sources for: the tree shape, and how its size is chosen."""

    # 8 with the confidence stop below: alternating prompt by prompt (bench.alternate, README
    # "A slower Zen 4 host"), depth 8 ran 1.11x of depth 3 with the Qwen 1.5B target and its
    # 0.5B draft (accepted 3.41 vs 2.48 tokens per step) and 1.08x with SmolLM2 (plain there)
    depth: int = Field(8, ge=0, le=64, description="draft tokens per path (0 = plain decoding)")
    width: int = Field(1, ge=1, le=64, description="nodes kept per depth level (1 = chain)")
    min_probability: float = Field(
        0.6, ge=0, lt=1, description="draft models stop below the first level whose likeliest "
                                     "node they give less than this probability (HF assisted "
                                     "generation's confidence threshold; 0 = full depth)")
    source: Literal["model", "datastore", "both"] = Field(
        "model", description="who drafts: the draft model(s), the lookup datastore (SSSD), or "
                             "both merged into one tree")
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
    voting: bool = Field(False, description="majority vote (Minions): every source drafts each "
                                            "step, their paths are merged by weighted vote and "
                                            "the voted path is verified (selection=fixed only)")
    vote_union_extra_s: float = Field(0.0, ge=0, description="voting: verify every source's path "
                                      "(the union) when its extra nodes cost at most this many "
                                      "seconds by the measured step-cost slope (0 = voted path "
                                      "only, as Minions)")


class DatastoreSettings(BaseModel):
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


class TelemetrySettings(BaseModel):
    """OpenTelemetry export; off unless an OTLP endpoint or the console exporter is set."""

    otlp_endpoint: str | None = Field(None, description="OTLP/gRPC collector, e.g. localhost:4317")
    console: bool = Field(False, description="print finished spans to stderr (debugging)")


class VerifierSettings(BaseModel):
    batch_size: int = Field(8, ge=1, description="trees verified together in one forward pass")
    max_batch_tokens: int = Field(1024, ge=1, description="new rows per forward pass (trees + "
                                  "prefill chunks); long prompts are prefilled in chunks")
    kv_budget_tokens: int = Field(16384, ge=16, description="KV rows held for all requests; when "
                                  "full, idle requests are evicted and re-prefilled later")
    kv_block_size: int = Field(16, ge=1, description="KV allocation unit (rows)")
    attention: Literal["auto", "torch", "triton", "flash-attn"] = Field(
        "auto", description="attention backend: auto = flash-attn/Triton on CUDA, torch on CPU")
    metrics_port: int | None = Field(None, ge=0, description="serve Prometheus metrics here")
    claim_idle_s: float = Field(30.0, gt=0, description="re-claim drafts unacknowledged this long")
    batch_wait_s: float | None = Field(
        None, ge=0, description="with fewer trees in hand than requests it is serving, wait this "
        "long for the others' trees to fill the batch (default: half the mean step time; "
        "0 = never wait)")
    name: str = Field("", description="consumer name in the pool (default: verifier-<pid>)")


class RouterSettings(BaseModel):
    step_timeout_s: float = Field(120.0, gt=0, description="give up on a step after this long")
    request_ttl_s: float = Field(3600.0, gt=0, description="pool state expiry of abandoned requests")
    max_pending_trees: int = Field(8, ge=0, description="back-pressure: pause drafting while this "
                                   "many trees wait in the pool (the verifier's batch size; "
                                   "0 = never)")
    draft_batch_max: int = Field(64, ge=1, description="micro-batching: most Draft/Lookup items "
                                                       "sent in one call")


class Settings(BaseSettings):
    """Everything a specmesh process can be told. Each role reads the parts it needs."""

    model_config = SettingsConfigDict(env_prefix="SPECMESH_", env_nested_delimiter="__",
                                      extra="ignore")

    model: str = Field(DEFAULT_MODEL, description="target model: a known name or a local HF directory")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="target/draft dtype; auto = bfloat16 where the hardware runs it fast")
    linear: Literal["auto", "torch", "onednn", "fp16"] = Field(
        "auto", description="CPU kernels of the models' linear layers: onednn = weights packed once "
                            "(cost nearly flat in the rows of a verify step); fp16 = bf16 weights "
                            "stored as float16 for FBGEMM (CPUs without bf16 arithmetic); auto = "
                            "onednn where the CPU runs the dtype, else fp16 for bf16, else torch")
    drafters: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="draft models: 'layers:N' (first N layers of the target) or a model name/dir, "
                    "optionally '@int8' or '@int4' (quantized weights); empty = the target's "
                    "default draft")
    draft_vocab: int = Field(0, ge=0, description="draft models' LM heads over the N most "
                             "frequent tokens of the datastore's corpus (FR-Spec: a cheaper "
                             "drafting forward, the output unchanged); 0 = the whole vocabulary")
    draft_runner: Literal["auto", "lean", "transformers"] = Field(
        "auto", description="draft models' forward: lean = specmesh's decoder loop for Llama / "
                            "Qwen2 drafts (fused products, preallocated KV rows, logits over the "
                            "draft vocabulary only: services/drafter/lean.py); transformers = the "
                            "model's own forward; auto = lean where the architecture allows")
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    cache_dir: Path = Field(Path.home() / ".cache" / "specmesh", description="converted weights")
    run_dir: Path | None = Field(None, description="state and logs of `specmesh up` "
                                                   "[<cache_dir>/run]")
    redis_url: str | None = Field(None, description="Redis of the pool (multi-process mode)")
    pool_prefix: str = Field("specmesh", description="key prefix of the pool in Redis")
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request gives none")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens accepted")
    host: str = Field("127.0.0.1", description="interface services listen on")
    port: int = Field(0, ge=0, le=65535, description="port of this service (0 = any free port)")
    router_address: str = Field("127.0.0.1:50052", description="gateway -> router")
    drafter_address: str = Field("127.0.0.1:50053", description="router -> drafter")
    datastore_address: str = Field("127.0.0.1:50055", description="router -> datastore")
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    verifier: VerifierSettings = Field(default_factory=VerifierSettings)
    datastore: DatastoreSettings = Field(default_factory=DatastoreSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    log_level: str = Field("INFO", description="logging level")

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
        """A copy with the given (non-None) fields replaced; nested sections as dicts or dotted keys."""
        data = self.model_dump()
        for key, value in overrides.items():
            if value is None:
                continue
            section, _, leaf = key.partition(".")
            if leaf:
                data[section][leaf] = value
            else:
                data[key] = value
        return Settings.model_validate(data)
