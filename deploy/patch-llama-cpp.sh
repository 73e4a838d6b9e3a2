#!/usr/bin/env bash
# Changes llama.cpp's CPU kernels before they are compiled. $1: the llama.cpp source tree
# (holding ggml/). Idempotent; a tree without the code a change expects (a later version) is
# left as it is for that change.
#
# A. Tiled Q4_1 and Q6_K products (deploy/llama-cpp/sgemm-*.inc): llamafile_sgemm gains these
#    weight types on x86 (AVX2), so a batch of several tokens (a tree's nodes) shares each
#    weight block's unpacking instead of paying a one-token step per token.
#
# B. The AMX matrix product (ggml-cpu/amx/mmq.cpp): without the fix every AMX CPU (Sapphire
# Rapids and later) gets SIGILL from the first tileloadd once llama.cpp repacks weights for AMX
# (its default).
#
# C. Flash attention (ggml-cpu/ops.cpp): a row skips the masked cells of a unified cache (other
#    requests' cells) 16 a compare; the same cells are summed, in the same order.
# D. Flash attention visits a row's heads one after another (those sharing a K/V head reuse
#    its cells in cache); every (row, head) is computed as before.
#
# ggml_tile_config_init() fills a tile_config_t on the stack for _tile_loadconfig():
# 1. GCC 12 does not see that builtin read the struct and drops the stores of the rows and
#    column widths: ldtilecfg loads zero-sized tiles. A compiler barrier that takes the
#    struct's address keeps the stores.
# 2. It loads the config once per thread (a thread_local flag), but another library on the
#    same OpenMP threads releases the tiles after its own AMX work (torch's oneDNN does, in the
#    same process as the verifier's drafters): the config is loaded on every call instead
#    (one ldtilecfg per thread per matrix product).
set -euo pipefail
SRC=${1:?usage: patch-llama-cpp.sh LLAMA_CPP_SOURCE_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)

# A. tiled Q4_1 and Q6_K: each kernel's file beside sgemm.cpp, included at the end of its
#    namespace, and a case in llamafile_sgemm's switch on the weight type
SGEMM="$SRC/ggml/src/ggml-cpu/llamafile/sgemm.cpp"
tile() {  # TYPE (as GGML_TYPE_*), activation type, block types, kernel file
    local type=$1 btype=$2 ablock=$3 bblock=$4 inc=$5 class=tinyBLAS_${1}_AVX
    grep -q "$inc" "$SGEMM" && return 0
    if [ "$(grep -c '^} // namespace$' "$SGEMM")" != 1 ] || ! grep -q '^    case GGML_TYPE_IQ4_NL: {$' "$SGEMM" ||
       grep -q "case GGML_TYPE_$type:" "$SGEMM"; then
        echo "patch-llama-cpp.sh: $SGEMM is not the one this patch knows; $type left untiled" >&2
        return 0
    fi
    cp "$HERE/llama-cpp/$inc" "$(dirname "$SGEMM")/"
    sed -i "s|^} // namespace\$|#include \"$inc\"  // specmesh: tiled $type\n} // namespace|" "$SGEMM"
    sed -i "s|^    case GGML_TYPE_IQ4_NL: {\$|    case GGML_TYPE_$type: {  // specmesh: $inc\\
#if defined(__AVX2__)\\
        if (Btype != GGML_TYPE_$btype)\\
            return false;\\
        $class tb{k, (const $ablock *)A, lda, (const $bblock *)B, ldb,\\
                  (float *)C, ldc, params->ith, params->nth};\\
        tb.matmul(m, n);\\
        return true;\\
#else\\
        return false;\\
#endif\\
    }\\
\\
&|" "$SGEMM"
}
if [ -f "$SGEMM" ]; then
    tile Q4_1 Q8_1 block_q4_1 block_q8_1 sgemm-q4_1.inc
    tile Q6_K Q8_K block_q6_K block_q8_K sgemm-q6_K.inc
fi
# ggml's tiled K-quant path takes every product of 8 tokens or more and unpacks the whole
# matrix whatever the count: Q6_K goes to the kernel above below 32 tokens (AVX2 builds)
TILED="$SRC/ggml/src/ggml-cpu/tiled/tiled.cpp"
if [ -f "$TILED" ] && grep -q sgemm-q6_K.inc "$SGEMM" && ! grep -q 'specmesh: sgemm-q6_K' "$TILED"; then
    if [ "$(grep -c '^    if (!ggml_tiled_min_batch(dst->src\[1\]->ne\[1\])) {$' "$TILED")" = 1 ]; then
        sed -i 's|^    if (!ggml_tiled_min_batch(dst->src\[1\]->ne\[1\])) {$|    if (!ggml_tiled_min_batch(dst->src[1]->ne[1]) \|\|\
        (specmesh_q6_k_sgemm \&\& dst->src[0]->type == GGML_TYPE_Q6_K \&\& dst->src[1]->ne[1] < 32)) {  // specmesh: sgemm-q6_K.inc|' "$TILED"
        sed -i 's|^static bool ggml_tiled_min_batch(int64_t rows) {$|#if defined(__AVX2__)  // specmesh: sgemm-q6_K.inc serves Q6_K below 32 tokens\
static constexpr bool specmesh_q6_k_sgemm = true;\
#else\
static constexpr bool specmesh_q6_k_sgemm = false;\
#endif\
\
&|' "$TILED"
    else
        echo "patch-llama-cpp.sh: $TILED is not the one this patch knows; Q6_K keeps its tiled path from 8 tokens" >&2
    fi
fi

# C. Flash attention over a unified KV cache (ggml-cpu/ops.cpp): every row's attention loops
#    over all cells in use, other sequences' too, and skips a masked one after converting its
#    fp16 mask value; the served backend's one cache holds every request's cells (a tree's row
#    belongs to several sequences), so at batch 8 most cells a row visits are masked. The skip
#    now tests 16 mask values a compare (AVX2) for -inf (fp16 0xFC00) before the loop's own
#    test: the same cells are summed in the same order, so every result is unchanged.
OPS="$SRC/ggml/src/ggml-cpu/ops.cpp"
FA_MARK='specmesh: masked cells skipped 16 a compare'
if [ -f "$OPS" ] && ! grep -q "$FA_MARK" "$OPS"; then
    LOOP='        for (int64_t ic = ic_start; ic < ic_end; ++ic) {'
    TEST='            const float mv = mp ? slope\*GGML_CPU_FP16_TO_FP32(mp\[ic\]) : 0.0f;'
    if [ "$(grep -c "^$LOOP\$" "$OPS")" = 1 ] && [ "$(grep -c "^$TEST\$" "$OPS")" = 1 ] &&
       [ "$(grep -c '^static void ggml_compute_forward_flash_attn_ext_f16_one_chunk($' "$OPS")" = 1 ]; then
        sed -i "s|^$LOOP\$|&\\
            if (mp \&\& (ic = specmesh_next_unmasked(mp, ic, ic_end)) >= ic_end) {  // $FA_MARK\\
                break;\\
            }|" "$OPS"
        sed -i 's|^static void ggml_compute_forward_flash_attn_ext_f16_one_chunk($|// specmesh: the first cell from ic on whose mask is not -inf (fp16 0xFC00)\
static inline int64_t specmesh_next_unmasked(const ggml_fp16_t * mp, int64_t ic, int64_t end) {\
#if defined(__AVX2__)\
    const __m256i ninf = _mm256_set1_epi16((short) 0xFC00);\
    for (; ic + 16 <= end; ic += 16) {\
        const uint32_t masked = (uint32_t) _mm256_movemask_epi8(_mm256_cmpeq_epi16(\
            _mm256_loadu_si256((const __m256i *)(mp + ic)), ninf));\
        if (masked != 0xFFFFFFFFu) {\
            return ic + (__builtin_ctz(~masked) >> 1);\
        }\
    }\
#endif\
    while (ic < end \&\& mp[ic] == (ggml_fp16_t) 0xFC00) {\
        ++ic;\
    }\
    return ic;\
}\
\
&|' "$OPS"
        grep -q "$FA_MARK" "$OPS" || echo "patch-llama-cpp.sh: $OPS: the attention patch did not apply" >&2
    else
        echo "patch-llama-cpp.sh: $OPS is not the one this patch knows; attention left as it is" >&2
    fi
fi

# D. Flash attention's order of (row, head) pairs (ggml-cpu/ops.cpp): a batch's rows went
#    fastest, so with 8 requests' rows the heads that share a K/V head (grouped-query
#    attention) came 8 rows apart, each after 7 other requests' cells had passed through the
#    cache; heads now go fastest. Each pair is computed as before: results unchanged.
ORDER_MARK='specmesh: heads fastest'
if [ -f "$OPS" ] && ! grep -q "$ORDER_MARK" "$OPS"; then
    CHUNK='/^static void ggml_compute_forward_flash_attn_ext_f16_one_chunk($/,/^}$/'
    IQ2='        const int iq2 = (ir - iq3\*neq2\*neq1)\/neq1;'
    IQ1='        const int iq1 = (ir - iq3\*neq2\*neq1 - iq2\*neq1);'
    if [ "$(sed -n "$CHUNK{/^$IQ2\$/p;/^$IQ1\$/p}" "$OPS" | wc -l)" = 2 ]; then
        sed -i "$CHUNK{
s|^$IQ2\$|        const int iq1 = (ir - iq3*neq2*neq1)/neq2;  // $ORDER_MARK: GQA heads share K/V|
s|^$IQ1\$|        const int iq2 = (ir - iq3*neq2*neq1 - iq1*neq2);|
}" "$OPS"
        grep -q "$ORDER_MARK" "$OPS" || echo "patch-llama-cpp.sh: $OPS: the head-order patch did not apply" >&2
    else
        echo "patch-llama-cpp.sh: $OPS is not the one this patch knows; head order left as it is" >&2
    fi
fi

# B. AMX
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
