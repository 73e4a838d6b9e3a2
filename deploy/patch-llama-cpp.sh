#!/usr/bin/env bash
# Fixes llama.cpp's AMX matrix product (ggml-cpu/amx/mmq.cpp) before it is compiled; without
# it every AMX CPU (Sapphire Rapids and later) gets SIGILL from the first tileloadd once
# llama.cpp repacks weights for AMX (its default). $1: the llama.cpp source tree (holding ggml/).
#
# ggml_tile_config_init() fills a tile_config_t on the stack for _tile_loadconfig():
# 1. GCC 12 does not see that builtin read the struct and drops the stores of the rows and
#    column widths: ldtilecfg loads zero-sized tiles. A compiler barrier that takes the
#    struct's address keeps the stores.
# 2. It loads the config once per thread (a thread_local flag), but another library on the
#    same OpenMP threads releases the tiles after its own AMX work (torch's oneDNN does, in the
#    same process as the verifier's drafters): the config is loaded on every call instead
#    (one ldtilecfg per thread per matrix product).
# Idempotent; a tree without that code (a later version) is left as it is.
set -euo pipefail
SRC=${1:?usage: patch-llama-cpp.sh LLAMA_CPP_SOURCE_DIR}
FILE="$SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
MARK='specmesh: keep the tile config stores'
[ -f "$FILE" ] || exit 0
grep -q "$MARK" "$FILE" && exit 0
FUNC='/^inline void ggml_tile_config_init(void) {$/,/^}$/'
if [ "$(sed -n "$FUNC{/^    _tile_loadconfig(&tc);\$/p;/static thread_local bool done = false;/p}" "$FILE" | wc -l)" != 2 ]; then
    echo "patch-llama-cpp.sh: $FILE's ggml_tile_config_init is not the one this patch knows; left unpatched" >&2
    exit 0
fi
sed -i "$FUNC{
/static thread_local bool done = false;/,/^    }\$/d
/^    done = true;\$/d
s|^    _tile_loadconfig(&tc);\$|    __asm__ __volatile__(\"\" : : \"r\"(\&tc) : \"memory\");  // $MARK\n    _tile_loadconfig(\&tc);  // specmesh: on every call, another library may release the tiles|
}" "$FILE"
grep -q "$MARK" "$FILE"
