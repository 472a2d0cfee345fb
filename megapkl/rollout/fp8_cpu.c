/* Block-FP8 (e4m3) quantization and dequantization of CPU weights: the same numbers, bit for bit,
 * as the torch path of megapkl/rollout/fp8.py (quantize_block_fp8_torch, dequantize_block_fp8_torch).
 * Quantization takes two passes over each block row (a row of 128x128 blocks fits in L2, so the
 * second pass reads from cache). Written as plain branch-free scalar C that the compiler
 * vectorizes; compiled on first use by fp8_cpu.py.
 *
 * Per block with largest magnitude a:  s = max(fp32(a / 448), 2^-126)
 * per element:                         q = e4m3_rne(clamp(fp32(w / s), -448, 448))
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define E4M3_MAX 448.0f
#define MIN_SCALE 1.17549435e-38f /* 2^-126 */

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* e4m3fn of a finite fp32 x, saturated to +-448, round to nearest, ties to even. Works on |x| as
 * an integer (non-negative floats order like their bits), so the clamp is one integer min and the
 * only branch a single select: the compiler keeps it all in vector registers. */
static inline uint8_t e4m3_rne(float x) {
    uint32_t u = bits_of_f32(x);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7FFFFFFFu;
    a = a < 0x43E00000u ? a : 0x43E00000u; /* 448.0f */
    /* Subnormal range |x| < 2^-6: adding 2^14 (whose ulp is 2^-9, e4m3's subnormal step) makes the
     * FPU round |x| to a multiple of 2^-9; the low bits of the sum are then the code 0..8 (8 is
     * 2^-6, whose e4m3 code is also 8). */
    uint32_t sub = bits_of_f32(f32_of_bits(a) + 16384.0f) - 0x46800000u;
    /* Normal range: round the 23-bit mantissa to 3 bits (ties to even: add 2^19 - 1 plus the kept
     * lsb) and rebias the exponent from 127 to 7, code = (a >> 20) - (120 << 3), folded into the
     * same addition. A carry into the exponent is the right result. */
    uint32_t nrm = (a + (0x7FFFFu - (960u << 20)) + ((a >> 20) & 1u)) >> 20;
    uint32_t code = a < 0x3C800000u ? sub : nrm; /* 2^-6 */
    code |= sign; /* in 32 bits, then narrowed once: the compiler vectorizes this form best */
    return (uint8_t)code;
}

/* One quantizer per input type: ELEM is the stored type, MASK clears its sign bit (|w| as an ordered
 * integer), INF is the first Inf/NaN pattern, TO_F32 widens one element. Both passes run along whole
 * rows (sequential reads, no per-block horizontal reductions): pass 1 keeps a running max per column
 * in `colmax`, then reduces it per block; pass 2 divides each element by its column's block scale
 * (`colscale`). Returns 1 when the block row holds a NaN or Inf (its outputs are then unspecified). */
#define DEFINE_BLOCK_ROW(NAME, ELEM, MASK, INF, TO_F32)                                           \
static int NAME(const ELEM *restrict w, int64_t rows, int64_t cols, int64_t b0, int64_t b1,        \
                int64_t br, uint8_t *restrict q, float *restrict scale,                           \
                ELEM *restrict colmax, float *restrict colscale) {                                \
    int64_t nc = (cols + b1 - 1) / b1, r0 = br * b0, r1 = r0 + b0 < rows ? r0 + b0 : rows;        \
    memset(colmax, 0, cols * sizeof(ELEM));                                                       \
    for (int64_t r = r0; r < r1; r++) {                                                           \
        const ELEM *restrict row = w + r * cols;                                                  \
        for (int64_t c = 0; c < cols; c++) {                                                      \
            ELEM v = row[c] & MASK;                                                               \
            colmax[c] = v > colmax[c] ? v : colmax[c];                                            \
        }                                                                                         \
    }                                                                                             \
    for (int64_t j = 0; j < nc; j++) {                                                            \
        int64_t c0 = j * b1, c1 = c0 + b1 < cols ? c0 + b1 : cols;                                \
        ELEM m = 0;                                                                               \
        for (int64_t c = c0; c < c1; c++) m = colmax[c] > m ? colmax[c] : m;                      \
        if (m >= INF) return 1;                                                                   \
        float sj = TO_F32(m) / E4M3_MAX;                                                          \
        sj = sj < MIN_SCALE ? MIN_SCALE : sj;                                                     \
        scale[br * nc + j] = sj;                                                                  \
        for (int64_t c = c0; c < c1; c++) colscale[c] = sj;                                       \
    }                                                                                             \
    for (int64_t r = r0; r < r1; r++) {                                                           \
        const ELEM *restrict row = w + r * cols;                                                  \
        uint8_t *restrict out = q + r * cols;                                                     \
        for (int64_t c = 0; c < cols; c++) out[c] = e4m3_rne(TO_F32(row[c]) / colscale[c]);       \
        /* Fetch the next block row's matching row while this one computes: pass 1 of the next   \
         * block row then mostly reads from cache, and memory traffic overlaps the arithmetic. */ \
        if (r + b0 < rows)                                                                        \
            for (int64_t c = 0; c < cols; c += 64 / sizeof(ELEM))                                 \
                __builtin_prefetch(row + b0 * cols + c, 0, 1);                                    \
    }                                                                                             \
    return 0;                                                                                     \
}

/* The exported entry: all block rows over `threads` OpenMP threads (the process's OpenMP runtime,
 * torch's own when torch is loaded). Returns -1 on success, a block row holding NaN/Inf, or -2 when
 * the scratch rows could not be allocated. */
#define DEFINE_QUANTIZE(NAME, BLOCK_ROW, ELEM)                                                    \
int64_t NAME(const ELEM *w, int64_t rows, int64_t cols, int64_t b0, int64_t b1, int64_t threads,   \
             uint8_t *q, float *scale) {                                                          \
    int64_t nr = (rows + b0 - 1) / b0, bad = -1;                                                  \
    int oom = 0;                                                                                  \
    _Pragma("omp parallel num_threads(threads) reduction(max: bad) reduction(|: oom)")           \
    {                                                                                             \
        ELEM *colmax = malloc(cols * sizeof(ELEM));                                               \
        float *colscale = malloc(cols * sizeof(float));                                           \
        _Pragma("omp for schedule(static)")                                                       \
        for (int64_t br = 0; br < nr; br++) {                                                     \
            if (!colmax || !colscale) oom = 1;                                                    \
            else if (BLOCK_ROW(w, rows, cols, b0, b1, br, q, scale, colmax, colscale))            \
                bad = br > bad ? br : bad;                                                        \
        }                                                                                         \
        free(colmax);                                                                             \
        free(colscale);                                                                           \
    }                                                                                             \
    return oom ? -2 : bad;                                                                        \
}

static inline float bf16_to_f32(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }
static inline float u32_to_f32(uint32_t u) { return f32_of_bits(u); }

DEFINE_BLOCK_ROW(block_row_bf16, uint16_t, 0x7FFFu, 0x7F80u, bf16_to_f32)
DEFINE_BLOCK_ROW(block_row_f32, uint32_t, 0x7FFFFFFFu, 0x7F800000u, u32_to_f32)
DEFINE_QUANTIZE(megapkl_fp8_quantize_bf16, block_row_bf16, uint16_t)
DEFINE_QUANTIZE(megapkl_fp8_quantize_f32, block_row_f32, uint32_t)

/* ------------------------------------------------------------------------------- dequantization */

/* The fp32 value of an e4m3fn code (exact): normal codes rebias the exponent from 7 to 127, the
 * subnormal ones are m * 2^-9, and 0x7F / 0xFF are NaN. Selects on 32-bit integers only, so the
 * loop vectorizes. */
static inline float e4m3_to_f32(uint8_t b) {
    uint32_t mag = b & 0x7Fu;
    uint32_t normal = (mag << 20) + (120u << 23);
    uint32_t sub = bits_of_f32((float)(int32_t)mag * 0.001953125f); /* 2^-9 */
    uint32_t v = mag < 8u ? sub : (mag == 0x7Fu ? 0x7FC00000u : normal);
    return f32_of_bits(v | ((uint32_t)(b & 0x80u) << 24));
}

/* bf16 of an fp32, round to nearest, ties to even (a NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u = bits_of_f32(x);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    r = (u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x40u) : r;
    return (uint16_t)r;
}

static inline float f32_out(float x) { return x; }

/* w = e4m3(q) * s per block (fp32 product), stored through STORE: the numbers of the torch path
 * `q.float() * scale_inv` then `.to(dtype)`. */
#define DEFINE_DEQUANTIZE(NAME, OUT, STORE)                                                       \
void NAME(const uint8_t *q, int64_t rows, int64_t cols, int64_t b0, int64_t b1,                   \
          const float *scale, int64_t threads, OUT *w) {                                          \
    int64_t nc = (cols + b1 - 1) / b1;                                                            \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const uint8_t *restrict in = q + r * cols;                                                \
        const float *restrict s = scale + (r / b0) * nc;                                          \
        OUT *restrict out = w + r * cols;                                                         \
        for (int64_t j = 0; j < nc; j++) {                                                        \
            int64_t c0 = j * b1, c1 = c0 + b1 < cols ? c0 + b1 : cols;                            \
            float sj = s[j];                                                                      \
            for (int64_t c = c0; c < c1; c++) out[c] = STORE(e4m3_to_f32(in[c]) * sj);            \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_DEQUANTIZE(megapkl_fp8_dequantize_bf16, uint16_t, f32_to_bf16)
DEFINE_DEQUANTIZE(megapkl_fp8_dequantize_f32, float, f32_out)
