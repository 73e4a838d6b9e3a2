#!/usr/bin/env bash
# Installs llama-cpp-python (llama.cpp's kernels: --target-runner ggml) into the environment of
# the Python given as $1, at the version pinned by pyproject.toml's `ggml` extra, compiled for
# this CPU (-march=native) from its source with deploy/patch-llama-cpp.sh applied (tiled Q4_1
# and Q6_K products, the AMX fix); the wheel's local version label (+specmesh.N) tells the
# server the fixes are in. The wheel is cached per CPU kind (its SIMD flags) under
# $SPECMESH_WHEELS (default ~/.cache/specmesh/wheels), so a second setup installs in seconds and a
# host of another kind builds its own. A missing compiler or a failed build prints what to
# install and exits 0: the torch target keeps working without it.
set -uo pipefail
PYTHON=${1:?usage: install-ggml.sh PATH/TO/venv/bin/python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIN=$(grep -o 'llama-cpp-python==[0-9][0-9.]*' "$ROOT/pyproject.toml" | head -1)
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' |
        grep -E '^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512[a-z0-9_]*|amx_[a-z0-9]*)$' | sort | tr '\n' ' ')
KIND=$(printf '%s %s' "$(uname -m)" "$FLAGS" | md5sum | cut -c1-12)
CACHE=${SPECMESH_WHEELS:-$HOME/.cache/specmesh/wheels}/$KIND
LOCAL=specmesh.4  # bump when patch-llama-cpp.sh or llama-cpp/ change: every host rebuilds once
VERSION=${PIN#*==}+$LOCAL

if "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '$VERSION')" 2>/dev/null; then
    exit 0  # installed at the pinned version
fi
wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
    missing=""
    for tool in cmake c++ cc; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
    if [ -n "$missing" ]; then
        echo "specmesh: llama.cpp's kernels not installed: missing$missing (Debian: apt-get install cmake g++)." >&2
        echo "specmesh: the torch target works without them; rerun make setup once they are there." >&2
        exit 0
    fi
    echo "specmesh: building $PIN for this CPU (once per CPU kind, 5-10 min on 2 cores; cached in $CACHE)"
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.build-XXXXXX")
    if ! { "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "$PIN" &&
           tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp" &&
           src=$(ls -d "$tmp"/llama_cpp_python-*/) &&
           bash "$ROOT/deploy/patch-llama-cpp.sh" "$src/vendor/llama.cpp" &&
           sed -i "s/^__version__ = \"${PIN#*==}\"\$/__version__ = \"$VERSION\"/" "$src/llama_cpp/__init__.py" &&
           CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
               "$PYTHON" -m pip wheel -q --no-deps -w "$tmp" "$src"; } >"$tmp/build.log" 2>&1; then
        echo "specmesh: building $PIN failed (last lines of $tmp/build.log below); the torch target works without it." >&2
        tail -5 "$tmp/build.log" >&2
        exit 0
    fi
    mv "$tmp"/llama_cpp_python-*.whl "$CACHE"/ && rm -rf "$tmp"
    wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -1)
fi
"$PYTHON" -m pip install -q "$wheel" || {
    echo "specmesh: installing $wheel failed; the torch target works without it." >&2
    exit 0
}
