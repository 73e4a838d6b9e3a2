"""llama.cpp for bench/peers.py: built once from the llama.cpp source vendored in
llama-cpp-python's PyPI sdist, and driven through llama-server's HTTP API.

  build()        pip download the sdist, apply deploy/patch-llama-cpp.sh (the kernels and AMX fix
                 the served backend gets too), cmake the tools (-DGGML_NATIVE=ON, no curl, no
                 web UI) into <cache>/llama.cpp-<version>/; a stamp file makes later runs skip it
  LlamaServer    llama-server on a free port; `run(prompts, c)` sends token-id prompts to
                 /completion with c in flight and returns the tokens and wall times
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specmesh_services.launch.procs import free_port

TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-speculative")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF")  # the UI would be fetched from the hub
STAMP = "specmesh-built-5.json"  # -5: sources patched as the served backend's are (tiled Q4_1, Q6_K; attention: masks, head order)
PATCH = Path(__file__).resolve().parents[1] / "deploy" / "patch-llama-cpp.sh"


# ---------------------------------------------------------------------------------------------
# build


def built(cache: Path) -> Path | None:
    """The newest stamped build under `cache` (its bin/ folder), if any."""
    stamps = sorted(cache.glob(f"llama.cpp-*/{STAMP}"), key=lambda p: p.stat().st_mtime)
    return stamps[-1].parent / "bin" if stamps else None


def build(cache: Path, rebuild: bool = False, log=print) -> Path:
    """bin/ of a llama.cpp build: the cached one, else downloaded and compiled (minutes)."""
    if not rebuild and (found := built(cache)):
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                              "--no-binary", ":all:", "llama-cpp-python", "-d", tmp],
                             capture_output=True, text=True)
        if got.returncode:
            raise RuntimeError(f"pip download llama-cpp-python: {got.stderr.strip()[-300:]}")
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        root = cache / f"llama.cpp-{version}"
        if (root / STAMP).is_file() and not rebuild:
            return root / "bin"
        log(f"llama.cpp: building the source of llama-cpp-python {version} into {root}")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(Path(tmp) / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp",
                    root / "src")
    (root / "src" / ".git").unlink(missing_ok=True)  # a submodule's pointer into the sdist's repo
    _logged(["bash", PATCH, root / "src"], root / "build.log")
    start = time.perf_counter()
    build_dir, build_log = root / "build", root / "build.log"
    _logged(["cmake", "-S", root / "src", "-B", build_dir, *CMAKE_FLAGS], build_log)
    targets = _available(build_dir)
    _logged(["cmake", "--build", build_dir, "-j", str(os.cpu_count() or 1), "--target",
             *targets], build_log)
    (root / "bin").unlink(missing_ok=True)
    (root / "bin").symlink_to(build_dir / "bin")
    seconds = time.perf_counter() - start
    (root / STAMP).write_text(json.dumps({"version": version, "targets": targets,
                                          "flags": CMAKE_FLAGS, "build_s": round(seconds)}))
    log(f"llama.cpp: built {', '.join(targets)} in {seconds:.0f} s")
    return root / "bin"


def _logged(args: list, log_path: Path) -> None:
    """Runs a build step, its output appended to log_path; RuntimeError with its last lines."""
    with open(log_path, "a") as log:
        code = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{args[0]} {args[1]} failed ({log_path}): {' | '.join(tail)}")


def _available(build_dir: Path) -> list[str]:
    """TARGETS this llama.cpp version defines (llama-speculative is an example that may go)."""
    listing = subprocess.run(["cmake", "--build", build_dir, "--target", "help"], check=True,
                             capture_output=True, text=True).stdout
    names = {line.removeprefix("... ").split()[0] for line in listing.splitlines()
             if line.startswith("... ")}
    return [t for t in TARGETS if t in names]


def stamp(bin_dir: Path) -> dict:
    """What the build recorded: version, targets, flags, build_s."""
    return json.loads((bin_dir.parent / STAMP).read_text())


def quant(path: Path) -> str:
    """The GGUF's weight type as llama.cpp names it (Q4_K_M, Q4_1, ...), else its file name."""
    try:
        import gguf as gguf_py

        field = gguf_py.GGUFReader(path).fields["general.file_type"]
        return gguf_py.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix(
            "MOSTLY_")
    except Exception:  # noqa: BLE001 - a label only
        return path.name


# ---------------------------------------------------------------------------------------------
# serving


class LlamaServer:
    """llama-server with `parallel` slots, each of `slot_ctx` tokens; a context manager."""

    def __init__(self, bin_dir: Path, model: Path, threads: int, parallel: int, slot_ctx: int,
                 extra: list[str], log_path: Path):
        self.port = free_port()
        self.args = [str(bin_dir / "llama-server"), "-m", str(model), "--port", str(self.port),
                     "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
                     "--parallel", str(parallel), "-c", str(slot_ctx * parallel),
                     "--no-webui", *map(str, extra)]
        self.log_path = log_path

    def __enter__(self) -> "LlamaServer":
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}: "
                                   f"{self._tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server not healthy after 300 s: {self._tail()}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def _tail(self) -> str:
        self.log.flush()
        return " | ".join(self.log_path.read_text().strip().splitlines()[-5:])

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    def run(self, prompts: list[list[int]], max_tokens: int, c: int, on_done=lambda: None
            ) -> tuple[list[list[int]], list[float], float, list[dict]]:
        """(tokens, seconds per request, wall seconds, server timings) with c in flight."""
        def one(ids: list[int]):
            start = time.perf_counter()
            out = self.complete(ids, max_tokens)
            on_done()
            return out, time.perf_counter() - start

        self.complete(prompts[0][:16], 4)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            done = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        return ([out["tokens"] for out, _ in done], [s for _, s in done], wall,
                [out.get("timings", {}) for out, _ in done])
