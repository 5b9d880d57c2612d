/* The product of a few quantized rows with an int8 weight, summed in int32: a decode
 * step's int8 layers and vocabulary projection without a GEMM library's packing of the
 * rows and dispatch around it (kernels._int8_dot).
 *
 * int8_dot_<dtype>: q (M, K) uint8 rows on a grid of `steps` steps around `zero`
 * (kernels.Grid, csrc/int8.c's quantize_rows), ldq bytes apart (a multiple of 4, zeros
 * from K on: read four bytes at a time, each a broadcast load); amax (M,) their maxima;
 * a weight (N, K) int8 packed in quads (below), its column sums colsum (N,) int32 and
 * scales (N,) float32; bias (N,) in <dtype> or NULL; out (M, N) in <dtype>, rows ldo
 * apart:
 *     acc[i, n] = sum_k q[i, k] * w[n, k] - zero * colsum[n]       (int32, exact)
 *     out[i, n] = fmaf((float)acc[i, n] * scale[n], amax[i] / steps, bias[n])
 * rounded once to <dtype>. The sum is an integer sum, exact on every path as long as
 * the path does not saturate (the 7-bit grid on AVX2, see below), so a row's result is
 * the same whatever rows share the call and whichever path runs it.
 *
 * The weight comes packed by DOT_COLUMNS output columns and quads of k, zero past N
 * and past K:
 *     packed[(n / 16) * K4 * 64 + (k / 4) * 64 + (n % 16) * 4 + k % 4] = w[n, k]
 * with K4 = ceil(K / 4): one quad of 16 columns is 64 bytes, what one 512-bit register
 * (or two 256-bit ones) multiplies by a row's four bytes at a time.
 *
 * Paths: AVX-512 VNNI (vpdpbusd: u8 x s8 products summed in int32; 16 rows a tile);
 * AVX2 (vpmaddubsw sums pairs of products in int16, saturating: a grid of at most 127
 * in q keeps 2 x 127 x 127 below 32767, which kernels.activation_grid's probe finds;
 * vpmaddwd then sums the pairs in int32; 4 rows a tile, 8 sums in registers); plain C.
 * While a tile sums one panel of the weight, the next is prefetched (as matmul.c).
 * Milliseconds a call, 51864 x 384 (tiny's vocabulary projection) at 16 / 11 / 8 rows, 2
 * threads, Intel Xeon with AMX, the weight warm in the caches: AVX2 2.05 / 1.45 / 1.10
 * (6 rows a tile: 2.25 / 1.47 / 1.10; a row's quad gathered from bytes instead of one
 * broadcast load: 3.13 / 2.01 / 1.56); VNNI 0.89 / 0.56 / 0.43.
 *
 * Built by native.py with -ffp-contract=off: no fused multiply-add but the one written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "floats.h"

#define DOT_COLUMNS 16
#define QUAD_BYTES (4 * DOT_COLUMNS)

int64_t dot_columns(void) { return DOT_COLUMNS; }

/* Row i's four bytes at quad kq: rows are ldq bytes apart, ldq a multiple of 4 with
 * zeros from K on (the caller pads them). */
static inline int32_t quad(const uint8_t *q, int64_t i, int64_t kq, int64_t ldq) {
    int32_t a;
    memcpy(&a, q + i * ldq + kq * 4, sizeof a);
    return a;
}

/* The output is written by panels of DOT_COLUMNS columns, each panel's rows in turn: one
 * run of each row a panel, rows ldo elements apart. Where the output is not in the cache
 * (a window's 1500 rows, written once), the line of each run is read for ownership from
 * memory before it is written, and in that order those reads wait one by one: the
 * encoder's 500 x 384 -> 1536 tile took 2.7-3.2 ms with a new output against 1.9-2.1
 * with one in the cache (held to AVX2, Intel Xeon with AMX). So each tile of rows first
 * asks, for writing, for the lines of the `rows` rows `ahead` rows after its first, in
 * the same panel: a tile or two later they are there. */
static inline void prefetch_out(const void *out, int64_t elem, int64_t ldo, int64_t M,
                                int64_t n0, int64_t m0, int64_t rows, int64_t ahead) {
    for (int64_t i = m0 + ahead; i < m0 + ahead + rows && i < M; i++)
        __builtin_prefetch((const char *)out + (i * ldo + n0) * elem, 1, 3);
}

/* The row's sums r (16 columns) to its outputs, as many as remain before N. */
#define STORE_ROW(i, r, STORE)                                                            \
    {                                                                                      \
        const float a = amax[m0 + (i)] / steps;                                            \
        T *o = out + (m0 + (i)) * ldo + n0;                                                \
        for (int64_t j = 0; j < left; j++) {                                               \
            const float v = (float)((r)[j] - zero * cs[j]) * s[j];                         \
            o[j] = STORE(fmaf(v, a, c[j]));                                                \
        }                                                                                  \
    }

#define OUT_AHEAD (2 * DOT_ROWS) /* rows: see prefetch_out */
#define PREFETCH_NEXT_PANEL(wk) __builtin_prefetch((wk) + K4 * QUAD_BYTES, 0, 2)

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define DOT_ROWS 16
#define DOT_TILE(MB, STORE)                                                                \
    {                                                                                      \
        __m512i acc[MB];                                                                   \
        for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_si512();                      \
        for (int64_t kq = 0; kq < K4; kq++) {                                              \
            const int8_t *wk = wb + kq * QUAD_BYTES;                                       \
            PREFETCH_NEXT_PANEL(wk);                                                       \
            const __m512i w = _mm512_loadu_si512((const void *)wk);                        \
            for (int i = 0; i < MB; i++) {                                                 \
                const int32_t a = quad(q, m0 + i, kq, ldq);                           \
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(a), w);             \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < MB; i++) {                                                     \
            int32_t r[DOT_COLUMNS];                                                        \
            _mm512_storeu_si512((void *)r, acc[i]);                                        \
            STORE_ROW(i, r, STORE)                                                         \
        }                                                                                  \
    }
#elif defined(__AVX2__)
#include <immintrin.h>
#define DOT_ROWS 4
#define DOT_TILE(MB, STORE)                                                                \
    {                                                                                      \
        __m256i lo[MB], hi[MB];                                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                         \
        for (int i = 0; i < MB; i++) lo[i] = hi[i] = _mm256_setzero_si256();               \
        for (int64_t kq = 0; kq < K4; kq++) {                                              \
            const int8_t *wk = wb + kq * QUAD_BYTES;                                       \
            PREFETCH_NEXT_PANEL(wk);                                                       \
            const __m256i wl = _mm256_loadu_si256((const __m256i *)wk);                    \
            const __m256i wh = _mm256_loadu_si256((const __m256i *)(wk + 32));             \
            for (int i = 0; i < MB; i++) {                                                 \
                const __m256i a = _mm256_set1_epi32(quad(q, m0 + i, kq, ldq));        \
                lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, wl), ones)); \
                hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, wh), ones)); \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < MB; i++) {                                                     \
            int32_t r[DOT_COLUMNS];                                                        \
            _mm256_storeu_si256((__m256i *)r, lo[i]);                                      \
            _mm256_storeu_si256((__m256i *)(r + 8), hi[i]);                                \
            STORE_ROW(i, r, STORE)                                                         \
        }                                                                                  \
    }
#else
#define DOT_ROWS 1
#define DOT_TILE(MB, STORE)                                                                \
    {                                                                                      \
        int32_t r[DOT_COLUMNS] = {0};                                                      \
        const uint8_t *row = q + m0 * K;                                                   \
        for (int64_t kq = 0; kq < K4; kq++) {                                              \
            const int8_t *wk = wb + kq * QUAD_BYTES;                                       \
            uint8_t b[4];                                                                  \
            const int32_t a = quad(q, m0, kq, ldq);                                            \
            memcpy(b, &a, sizeof b);                                                       \
            for (int j = 0; j < DOT_COLUMNS; j++)                                          \
                for (int t = 0; t < 4; t++) r[j] += (int32_t)b[t] * wk[j * 4 + t];         \
        }                                                                                  \
        STORE_ROW(0, r, STORE)                                                             \
    }
#endif

/* The tile for the rows left: a tile's rows are a constant (its sums stay in registers). */
#if DOT_ROWS >= 16
#define DOT_WIDE_TILES(STORE)                                                              \
    case 16: DOT_TILE(16, STORE) break;                                                    \
    case 15: DOT_TILE(15, STORE) break;                                                    \
    case 14: DOT_TILE(14, STORE) break;                                                    \
    case 13: DOT_TILE(13, STORE) break;                                                    \
    case 12: DOT_TILE(12, STORE) break;                                                    \
    case 11: DOT_TILE(11, STORE) break;                                                    \
    case 10: DOT_TILE(10, STORE) break;                                                    \
    case 9: DOT_TILE(9, STORE) break;                                                      \
    case 8: DOT_TILE(8, STORE) break;                                                      \
    case 7: DOT_TILE(7, STORE) break;                                                      \
    case 6: DOT_TILE(6, STORE) break;                                                      \
    case 5: DOT_TILE(5, STORE) break;
#else
#define DOT_WIDE_TILES(STORE)
#endif
#if DOT_ROWS >= 4
#define DOT_ROWS_SWITCH(rows, STORE)                                                       \
    switch (rows) {                                                                        \
    DOT_WIDE_TILES(STORE)                                                                  \
    case 4: DOT_TILE(4, STORE) break;                                                      \
    case 3: DOT_TILE(3, STORE) break;                                                      \
    case 2: DOT_TILE(2, STORE) break;                                                      \
    default: DOT_TILE(1, STORE) break;                                                     \
    }
#else
#define DOT_ROWS_SWITCH(rows, STORE) (void)(rows); DOT_TILE(1, STORE)
#endif

#define DOT(NAME, TYPE, LOAD, STORE)                                                       \
    void NAME(const uint8_t *q, int64_t M, int64_t K, int64_t ldq, const int8_t *packed,                \
              const int32_t *colsum, int64_t N, const float *scale, const float *amax,     \
              float steps, int32_t zero, const TYPE *bias, TYPE *out, int64_t ldo,         \
              int threads) {                                                               \
        typedef TYPE T;                                                                    \
        const int64_t K4 = (K + 3) / 4;                                                    \
        const int64_t tiles = (N + DOT_COLUMNS - 1) / DOT_COLUMNS;                         \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t t = 0; t < tiles; t++) {                                              \
            const int64_t n0 = t * DOT_COLUMNS;                                            \
            const int64_t left = N - n0 < DOT_COLUMNS ? N - n0 : DOT_COLUMNS;              \
            const int8_t *wb = packed + t * K4 * QUAD_BYTES;                               \
            const int32_t *cs = colsum + n0;                                               \
            const float *s = scale + n0;                                                   \
            float c[DOT_COLUMNS];                                                          \
            for (int64_t j = 0; j < left; j++) c[j] = bias ? LOAD(bias[n0 + j]) : 0.0f;    \
            for (int64_t m0 = 0; m0 < M; m0 += DOT_ROWS) {                                 \
                const int64_t rows = M - m0 < DOT_ROWS ? M - m0 : DOT_ROWS;                \
                prefetch_out(out, sizeof(T), ldo, M, n0, m0, rows, OUT_AHEAD);             \
                DOT_ROWS_SWITCH(rows, STORE)                                               \
            }                                                                              \
        }                                                                                  \
    }

DOT(int8_dot_f32, float, as_float, as_float)
DOT(int8_dot_bf16, uint16_t, from_bf16, to_bf16)
