"""The `device` setting: what auto / cpu / cuda[:N] resolve to, CUDA refused at start-up where
torch sees no GPU (one line, exit 2, before any model loads), and what CUDA cannot serve (the
CPU kernels) refused with a reason. The CUDA serving tests themselves are in test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from specmesh_services.common import device
from specmesh_services.common.config import Settings, SettingsError
from specmesh_services.drafter.models import DraftSpec
from specmesh_services.launch import cli

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


def test_auto_and_cpu_resolve_to_what_torch_sees():
    want = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    assert device.resolve_device("auto") == want
    assert device.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "tpu:0"])
def test_a_device_that_is_no_device_is_refused_by_the_settings(bad):
    with pytest.raises(SettingsError, match="device"):
        Settings().with_overrides(device=bad)
    with pytest.raises(SettingsError, match="expected auto, cpu, cuda or cuda:N"):
        device.resolve_device(bad)


@no_gpu
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_refused_saying_so(name):
    with pytest.raises(SettingsError, match="torch sees no CUDA device"):
        device.resolve_device(name)


@no_gpu
@pytest.mark.parametrize("argv", [["run", "hello", "--device", "cuda"],
                                  ["serve", "verifier", "--device", "cuda:0"],
                                  ["serve", "drafter", "--device", "cuda"]])
def test_the_cli_refuses_cuda_without_a_gpu_in_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specmesh: error: device 'cuda") and "torch sees no CUDA device" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.fixture
def one_gpu(monkeypatch):
    """torch reporting one CUDA device (checks of the refusal rules only: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_cuda_index_beyond_the_visible_gpus_is_refused(one_gpu):
    assert device.resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(SettingsError, match=r"sees 1 CUDA device\(s\) \(0..0\)"):
        device.resolve_device("cuda:1")


@pytest.mark.parametrize("overrides, reason", [
    ({"verifier.exact": True}, "verifier.exact needs --device cpu"),
    ({"verifier.prune": "on"}, "early pruning"),
    ({"linear": "onednn"}, "names a CPU kernel"),
    ({"target_weights": "native"}, "int4 kernel runs on the CPU only"),
])
def test_what_only_the_cpu_serves_is_refused_on_cuda(one_gpu, overrides, reason):
    settings = Settings().with_overrides(device="cuda", **overrides)
    with pytest.raises(SettingsError, match=reason):
        device.check(settings)
    assert device.check(settings.with_overrides(device="cpu")) == torch.device("cpu")


def test_draft_quantization_is_a_cpu_choice():
    assert DraftSpec.parse("smollm2-135m@auto").quantized("cuda") is None
    assert DraftSpec.parse("smollm2-135m").quantized("cuda") is None
    with pytest.raises(ValueError, match="@int8 run on the CPU only"):
        DraftSpec.parse("smollm2-135m@int8").quantized("cuda")
    assert DraftSpec.parse("smollm2-135m@int8").quantized("cpu") == "int8"


def test_up_gives_each_model_process_its_gpu(tmp_path):
    from specmesh_services.launch.stack import Stack

    stack = Stack(Settings(), 0, tmp_path, verifiers=2, drafting=2, gpus=(0, 1, 2))
    env = {name: stack.device_env(role, name) for role, name in [
        ("verifier", "verifier"), ("verifier", "verifier-2"), ("drafter", "drafter"),
        ("drafter", "drafter-2"), ("router", "router"), ("gateway", "gateway"),
        ("datastore", "datastore")]}
    assert [env[n].get("CUDA_VISIBLE_DEVICES") for n in
            ("verifier", "verifier-2", "drafter", "drafter-2")] == ["0", "1", "2", "0"]
    assert all(env[n]["SPECMESH_DEVICE"] == "cuda" for n in ("verifier", "drafter-2"))
    assert all(env[n] == {"CUDA_VISIBLE_DEVICES": ""} for n in ("router", "gateway", "datastore"))
    assert Stack(Settings(), 0, tmp_path).device_env("verifier", "verifier") == {}


@pytest.mark.parametrize("bad", ["0,x", "-1", ""])
def test_up_refuses_a_gpu_list_that_is_none(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["up", "--gpus", bad])
    assert exit_.value.code == 2 and "--gpus" in capsys.readouterr().err
