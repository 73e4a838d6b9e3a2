"""Hugging Face Hub ids as model names, offline: a Hub cache laid out as huggingface_hub writes
it (content-addressed blobs, snapshot files linking to them, refs/main naming the commit), built
from the converted default model; its snapshot loads and predicts as the known name does, and a
missing id is a one-line error naming HF_HUB_OFFLINE."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from specmesh_services.common import models
from specmesh_services.drafter.models import DraftSpec

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = hashlib.sha1(b"specmesh test snapshot").hexdigest()


def blob_name(file: Path) -> str:
    """The name huggingface_hub gives a file's blob: its sha256 for LFS files (weights), its
    git blob id for the others."""
    if file.suffix == ".safetensors":
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        return digest.hexdigest()
    data = file.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str) -> Path:
    """`source`'s files as a download of `repo_id` at `commit` into the Hub cache `cache`;
    returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if file.name == models.CONVERTED_MARKER:  # specmesh's, not the repository's
            continue
        blob = repo / "blobs" / blob_name(file)
        try:
            os.link(file, blob)  # the same bytes without copying the weights
        except OSError:
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, target_path) -> tuple[Path, Path]:
    """(the Hub cache, REPO's snapshot in it)."""
    cache = tmp_path_factory.mktemp("hub").resolve()
    return cache, cache_repo(cache, REPO, target_path, COMMIT)


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    """The test cache as the Hub cache, offline (huggingface_hub reads both variables at import:
    its constants are set too); returns REPO's snapshot."""
    cache, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_is_its_cached_snapshot(offline_hub, tmp_path):
    assert models.resolve(REPO, tmp_path) == offline_hub
    assert models.resolve(f"{REPO}@main", tmp_path) == offline_hub
    assert models.resolve(f"{REPO}@{COMMIT}", tmp_path) == offline_hub
    assert not (tmp_path / "models").exists()  # nothing converted into specmesh's cache


def test_a_draft_spec_names_a_hub_id(offline_hub, tmp_path):
    spec = DraftSpec.parse(f"{REPO}@int8")
    assert (spec.base, spec.weights, spec.layers) == (REPO, "int8", None)
    assert models.resolve(spec.base, tmp_path) == offline_hub


def test_a_hub_model_predicts_as_the_known_name(offline_hub, tmp_path, target_path, tokenizer,
                                                hf_target):
    path = models.resolve(REPO, tmp_path)
    hub_tokenizer = models.load_tokenizer(path)
    assert hub_tokenizer.get_vocab() == tokenizer.get_vocab()
    config, reference_config = (models.load_config(p).to_dict() for p in (path, target_path))
    assert config.pop("_name_or_path") == str(path)
    reference_config.pop("_name_or_path")
    assert config == reference_config
    assert models.eos_token_ids(path, hub_tokenizer) == models.eos_token_ids(target_path,
                                                                             tokenizer)
    ids = hub_tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(ids, tokenizer("The capital of France is", return_tensors="pt").input_ids)
    model = models.load_model(path, torch.float32)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1]
        reference = hf_target(ids).logits[0, -1]
    assert int(logits.argmax()) == int(reference.argmax())
    torch.testing.assert_close(logits, reference)


def test_a_hub_id_missing_offline_names_it_and_hf_hub_offline(offline_hub, tmp_path):
    with pytest.raises(models.ModelNotFound, match=r"'missing/model' is not in the Hugging Face "
                                                   r"cache .*HF_HUB_OFFLINE=0"):
        models.resolve("missing/model", tmp_path)
    with pytest.raises(models.ModelNotFound, match=f"'{REPO}@v9' .*HF_HUB_OFFLINE"):
        models.resolve(f"{REPO}@v9", tmp_path)  # a revision the cache has no ref of


@pytest.mark.parametrize("name", ["nope", "a/b/c", "-x/y", "a--b/c", "owner/name@"])
def test_a_name_that_is_no_hub_id_keeps_the_unknown_model_message(offline_hub, tmp_path, name):
    with pytest.raises(models.ModelNotFound, match=f"unknown model '{name}'.*smollm2-135m"):
        models.resolve(name, tmp_path)


def test_an_existing_local_path_is_never_taken_for_a_hub_id(offline_hub, tmp_path, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)  # no config.json
    monkeypatch.chdir(tmp_path)
    with pytest.raises(models.ModelNotFound, match="unknown model 'owner/name'"):
        models.resolve("owner/name", tmp_path)


@pytest.mark.parametrize("flag", ["--model", "--draft"])
def test_the_cli_reports_a_missing_hub_model_in_one_line(hub_cache, tmp_path, flag):
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache[0]), HF_HUB_OFFLINE="1",
               SPECMESH_RUN_DIR=str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-m", "specmesh_services.launch.cli", "run", flag,
                          "missing/model", "Hello"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert out.stderr.startswith("specmesh: error: model 'missing/model' is not in the Hugging "
                                 "Face cache"), out.stderr
    assert "HF_HUB_OFFLINE" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_hub_snapshot_with_pytorch_weights_only_loads(hub_cache, offline_hub, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    files = tmp_path / "files"
    config.save_pretrained(files)
    torch.save(model.state_dict(), files / "pytorch_model.bin")
    snapshot = cache_repo(hub_cache[0], "owner/bin-only", files, COMMIT)
    assert models.resolve("owner/bin-only", tmp_path) == snapshot
    ids = torch.tensor([[1, 5, 9, 2]])
    loaded = models.load_model(snapshot, torch.float32, linear="torch")
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)

    (files / "pytorch_model.bin").unlink()
    cache_repo(hub_cache[0], "owner/no-weights", files, COMMIT)
    with pytest.raises(models.ModelNotFound, match="'owner/no-weights': its snapshot .* lacks "
                                                   "config.json or weights"):
        models.resolve("owner/no-weights", tmp_path)
