/* One decode step's attention, computed in float32, in one pass over the cache.
 *
 * out[b, h] = softmax(q[b, h] . k[b, h]^T * scale) . v[b, h], one query per (b, h): what
 * kernels._attend_f32 computes. A decode step on the CPU is bound by reading its
 * cross-attention cache; here each key and value is read once, widened to float32 as it
 * is read (bf16), with no float32 copy of the cache written and read again, no (B, H, S)
 * score tensor, and no call per (batch, head) tile.
 *
 * counts, where not NULL, holds each batch row's key count: row b attends to its first
 * counts[b] keys (1..S), as if the call had only those (a decode step of rows at
 * different positions, once a batch is refilled: the same sums, in the same order, as
 * the row's own unmasked step).
 *
 * sources, where not NULL, holds for each batch row the row whose keys and values it
 * reads (equal to its own: rows of one window, the same encoder output), and the loop
 * then takes rows that read the same ones one after another, so that all but the first
 * find them in the CPU's cache rather than in memory; the arithmetic is the same. (11
 * rows of which 5 share, four layers of tiny.en's cross caches, AMD EPYC Zen 4: with
 * sources 0.5-0.8 of the time without, most runs 0.65-0.68, where that took 4.6-6.9 ms;
 * the rows sorted but taken row by row, 0.70-0.87.)
 *
 * Strides are in elements: q and out (batch, head), k (batch, head, key, dim), v (batch,
 * head, key). The last dimension of q, v and out is contiguous; k is contiguous along
 * its dims (keys by rows) or along its keys (_kcols: keys by column, as the f32 model
 * stores its cross keys). Built by whisper_cli/native.py with -ffast-math, which lets
 * the sums and exp vectorize: nothing here is NaN or infinite (the scores of finite
 * inputs are finite), and the order of a float32 sum is no part of the result's contract
 * (kernels.py: as exact as the reference).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "floats.h"

/* order[0..B): 0..B-1, or with sources, the rows sorted by source (stable: by row
 * within one source). */
static void row_order(int64_t B, const int64_t *sources, int64_t *order) {
    for (int64_t b = 0; b < B; b++) order[b] = b;
    if (!sources) return;
    for (int64_t b = 1; b < B; b++) { /* insertion sort: B is a batch's rows */
        const int64_t row = order[b];
        int64_t j = b;
        for (; j > 0 && sources[order[j - 1]] > sources[row]; j--) order[j] = order[j - 1];
        order[j] = row;
    }
}

/* The scores p[S] of one (b, h) are computed by SCORES; then softmax and the weighted
 * sum of the values, written to out. D <= 256 and S <= 4096 (native.py checks): the
 * scores and the float32 query live on the stack. */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE, SCORES)                                     \
    void NAME(const T *q, const T *k, const T *v, T *out, int64_t B, int64_t H, int64_t S, \
              int64_t D, const int64_t *qs, const int64_t *ks, const int64_t *vs,          \
              const int64_t *os, const int64_t *counts, const int64_t *sources,            \
              float scale, int threads) {                                                  \
        int64_t order[B]; /* with sources: the rows by their source */                     \
        row_order(B, sources, order);                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t i = 0; i < B * H; i++) {                                              \
            /* Rows that share keys and values run head by head, one after another: the  \
             * head's keys and values (S x D, twice) are still in the core's cache. */    \
            const int64_t b = sources ? order[i % B] : i / H;                              \
            const int64_t h = sources ? i / B : i % H;                                     \
            const int64_t from = sources ? sources[b] : b; /* whose keys and values */     \
            const int64_t n = counts ? counts[b] : S;      /* this row's keys */           \
            const T *qi = q + b * qs[0] + h * qs[1];                                       \
            const T *ki = k + from * ks[0] + h * ks[1];                                    \
            const T *vi = v + from * vs[0] + h * vs[1];                                    \
            float qf[D], acc[D], p[S];                                                     \
            for (int64_t d = 0; d < D; d++) qf[d] = LOAD(qi[d]) * scale;                   \
            SCORES(LOAD)                                                                   \
            float top = p[0];                                                              \
            for (int64_t s = 1; s < n; s++) top = p[s] > top ? p[s] : top;                 \
            float total = 0.0f;                                                            \
            for (int64_t s = 0; s < n; s++) {                                              \
                p[s] = expf(p[s] - top);                                                   \
                total += p[s];                                                             \
            }                                                                              \
            for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;                                 \
            for (int64_t s = 0; s < n; s++) {                                              \
                const T *row = vi + s * vs[2];                                             \
                for (int64_t d = 0; d < D; d++) acc[d] += p[s] * LOAD(row[d]);             \
            }                                                                              \
            T *o = out + b * os[0] + h * os[1];                                            \
            for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[d] / total);                  \
        }                                                                                  \
    }

/* Keys by rows: a dot product per key. */
#define KEY_ROWS(LOAD)                                                                     \
    for (int64_t s = 0; s < n; s++) {                                                      \
        const __typeof__(*k) *row = ki + s * ks[2];                                        \
        float dot = 0.0f;                                                                  \
        for (int64_t d = 0; d < D; d++) dot += qf[d] * LOAD(row[d]);                       \
        p[s] = dot;                                                                        \
    }

/* Keys by column: every score gains q[d] times column d, along the keys, COLUMNS columns
 * a pass. One column a pass loads and stores every score once per column, and those
 * loads and stores, not the keys' read, then bound the loop: 26-28 GB/s of keys and
 * values against 30-32 eight at a time, where two threads sum the same bytes at 32-34
 * (B 16, H 6, S 1500, D 64, four layers' caches; AMD EPYC Zen 4, 2 cores). */
#define COLUMNS 8
#define KEY_COLUMNS(LOAD)                                                                  \
    for (int64_t s = 0; s < n; s++) p[s] = 0.0f;                                           \
    int64_t d0 = 0;                                                                        \
    for (; d0 + COLUMNS <= D; d0 += COLUMNS) {                                             \
        const __typeof__(*k) *col = ki + d0 * ks[3];                                       \
        for (int64_t s = 0; s < n; s++) {                                                  \
            float x = p[s];                                                                \
            for (int64_t j = 0; j < COLUMNS; j++)                                          \
                x += qf[d0 + j] * LOAD(col[j * ks[3] + s]);                                \
            p[s] = x;                                                                      \
        }                                                                                  \
    }                                                                                      \
    for (; d0 < D; d0++) {                                                                 \
        const __typeof__(*k) *col = ki + d0 * ks[3];                                       \
        for (int64_t s = 0; s < n; s++) p[s] += qf[d0] * LOAD(col[s]);                     \
    }

DECODE_ATTENTION(decode_attention_bf16, uint16_t, from_bf16, to_bf16, KEY_ROWS)
DECODE_ATTENTION(decode_attention_f32, float, as_float, as_float, KEY_ROWS)
DECODE_ATTENTION(decode_attention_f32_kcols, float, as_float, as_float, KEY_COLUMNS)

/* The encoder's attention, computed in float32:
 * out[b, h] = softmax(q[b, h] . k[b, h]^T * scale) . v[b, h] for T queries over S keys,
 * unmasked (kernels._tiled). SDPA's CPU kernel runs it at 72-79 GFMA/s on the encoder's
 * shapes (two GEMMs of depth 64 and 1500 per head and a softmax over 1500 x 1500 scores;
 * AMD EPYC Zen 4, 2 cores). Here a head's keys are packed once into panels of KEYS
 * keys (the panel's D x KEYS floats contiguous, read in order by the product) and its
 * values copied contiguous, both then read from the core's cache by every tile of ROWS
 * queries: the tile's scores over all keys (ROWS x 2 vector accumulators), a softmax in
 * place with the exp below, and the weighted sum of the values (ROWS x 2 accumulators per
 * 2 x LANES columns). One layer of four tiny.en windows (B 4, H 6, T = S = 1500, D 64),
 * alternating calls: 75-81 ms against SDPA's 86-92 in float32, 75 against 100 in
 * bfloat16 (SDPA's bf16 kernel is the slower there).
 *
 * encoder_attention_bf16 widens q, k and v to float32 as it packs them and rounds each
 * output once. Strides are in elements: q, k, v and out (batch, head, row); the last
 * dimension of each is contiguous. D must be a multiple of LANES (encoder_attention_lanes()).
 * Returns 0, or -1 where a thread's buffers could not be allocated (nothing is then
 * written). */
#if defined(__AVX512F__)
#define LANES 16
#define ROWS 8
#else
#define LANES 8
#define ROWS 6 /* 2 x 6 accumulators of 8 lanes, two keys' vectors and a query: 15 of 16 */
#endif
#define KEYS (2 * LANES)

typedef float lanes_t __attribute__((vector_size(LANES * 4)));

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (a score minus its row's maximum): Cody-Waite reduction by ln 2 and
 * Cephes' polynomial for expf (error about 1 ulp; -ffast-math may fold the two parts of
 * ln 2 into one, ~2 ulp at most), against torch's vectorized
 * exp (the "u20" kernel its flash attention uses). Below -87 the result is exp(-87)
 * ~ 1.6e-38, where expf's would be smaller: a weight no float32 sum of order 1 keeps. */
static inline __attribute__((always_inline)) lanes_t exp_lanes(lanes_t x) {
#if defined(__AVX512F__)
    x = (lanes_t)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    const lanes_t n = (lanes_t)_mm512_roundscale_ps(
        (__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
    x = (lanes_t)_mm256_max_ps((__m256)x, _mm256_set1_ps(-87.0f));
    const lanes_t n = (lanes_t)_mm256_round_ps(
        (__m256)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    lanes_t y;
    for (int i = 0; i < LANES; i++) y[i] = expf(x[i] < -87.0f ? -87.0f : x[i]);
    return y;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    lanes_t r = x - n * 0.693359375f; /* ln 2 in two parts */
    r = r - n * -2.12194440e-4f;
    lanes_t p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const lanes_t y = p * (r * r) + r + 1.0f; /* exp(r), |r| <= ln(2) / 2 */
#endif
#if defined(__AVX512F__)
    return (lanes_t)_mm512_scalef_ps((__m512)y, (__m512)n); /* y * 2^n */
#elif defined(__AVX2__)
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32((__m256)n), 23);
    return (lanes_t)_mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256((__m256)y), e));
#endif
}

/* scores[r, :SP] = query[r] . keys for a tile's ROWS queries, over the head's panels. */
static void tile_scores(const float *query, const float *panels, int64_t SP, int64_t D,
                        float *scores) {
    for (int64_t j = 0; j < SP; j += KEYS) {
        const float *panel = panels + j * D;
        lanes_t a0[ROWS], a1[ROWS];
        for (int r = 0; r < ROWS; r++) a0[r] = a1[r] = (lanes_t){0};
        for (int64_t d = 0; d < D; d++) {
            const lanes_t k0 = *(const lanes_t *)(panel + d * KEYS);
            const lanes_t k1 = *(const lanes_t *)(panel + d * KEYS + LANES);
            for (int r = 0; r < ROWS; r++) {
                a0[r] += query[r * D + d] * k0;
                a1[r] += query[r * D + d] * k1;
            }
        }
        for (int r = 0; r < ROWS; r++) {
            *(lanes_t *)(scores + r * SP + j) = a0[r];
            *(lanes_t *)(scores + r * SP + j + LANES) = a1[r];
        }
    }
}

/* Each row's scores (S of SP) -> exp(score - max) in place, the padding's ~0; total[r]:
 * their sum. */
static void tile_softmax(float *scores, int64_t SP, int64_t S, float *total) {
    for (int r = 0; r < ROWS; r++) {
        float *p = scores + r * SP;
        float top = p[0];
        for (int64_t s = 1; s < S; s++) top = p[s] > top ? p[s] : top;
        for (int64_t s = S; s < SP; s++) p[s] = top - 1e30f;
        lanes_t sum = {0};
        for (int64_t s = 0; s < SP; s += LANES) {
            const lanes_t e = exp_lanes(*(const lanes_t *)(p + s) - top);
            *(lanes_t *)(p + s) = e;
            sum += e;
        }
        total[r] = 0.0f;
        for (int l = 0; l < LANES; l++) total[r] += sum[l];
    }
}

/* tile[r, :n LANES] = sum_s p[r, s] v[s, :n LANES] / total[r] for a tile's ROWS rows, n = 2
 * vectors of LANES columns, or 1 for the last columns: inlined with n constant. */
static inline __attribute__((always_inline)) void weigh_values(
    const float *p, int64_t ld, const float *v, int64_t S, int64_t D, const float *total,
    float *tile, const int n) {
    lanes_t a0[ROWS], a1[ROWS];
    for (int r = 0; r < ROWS; r++) a0[r] = a1[r] = (lanes_t){0};
    for (int64_t s = 0; s < S; s++) {
        const lanes_t v0 = *(const lanes_t *)(v + s * D);
        const lanes_t v1 = n == 2 ? *(const lanes_t *)(v + s * D + LANES) : (lanes_t){0};
        for (int r = 0; r < ROWS; r++) {
            a0[r] += p[r * ld + s] * v0;
            if (n == 2) a1[r] += p[r * ld + s] * v1;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        *(lanes_t *)(tile + r * D) = a0[r] / total[r];
        if (n == 2) *(lanes_t *)(tile + r * D + LANES) = a1[r] / total[r];
    }
}

int64_t encoder_attention_lanes(void) { return LANES; }

/* Each thread's buffers, float32, 64-byte aligned (sizes rounded up to 64 bytes, as
 * aligned_alloc asks): the head's keys in panels [SP / KEYS][D][KEYS], its values [S][D],
 * a tile's scores [ROWS][SP], queries (scaled) and outputs [ROWS][D]. */
#define ALIGNED_FLOATS(n) aligned_alloc(64, ((n) * sizeof(float) + 63) / 64 * 64)
#define ENCODER_BUFFERS(SP, S, D)                                                          \
    float *panels = ALIGNED_FLOATS((SP) * (D));                                            \
    float *values = ALIGNED_FLOATS((S) * (D));                                             \
    float *scores = ALIGNED_FLOATS(ROWS * (SP));                                           \
    float *query = ALIGNED_FLOATS(ROWS * (D));                                             \
    float *tile = ALIGNED_FLOATS(ROWS * (D));                                              \
    const int ok = panels && values && scores && query && tile;

/* The work is (batch, head, part) items: a head's queries in parts of whole tiles when
 * there are fewer heads than twice the threads (one window), so every thread has work;
 * a thread packs a head's keys and values when its next item is another head's. A
 * query's arithmetic is the same whatever the parts (its tile's other rows do not enter
 * it), so a row's output does not depend on the batch it runs in. */
#define ENCODER_ATTENTION(NAME, T, LOAD, STORE)                                            \
    int NAME(const T *q, const T *k, const T *v, T *out, int64_t B, int64_t H, int64_t TQ, \
             int64_t S, int64_t D, const int64_t *qs, const int64_t *ks, const int64_t *vs, \
             const int64_t *os, float scale, int threads) {                                \
        const int64_t SP = (S + KEYS - 1) / KEYS * KEYS; /* keys padded to whole panels */ \
        const int64_t tiles = (TQ + ROWS - 1) / ROWS;                                      \
        int64_t parts = B * H >= 2 * threads ? 1 : (2 * threads + B * H - 1) / (B * H);    \
        parts = parts < tiles ? parts : tiles;                                             \
        const int64_t per_part = (tiles + parts - 1) / parts * ROWS; /* queries */         \
        int failed = 0;                                                                    \
        _Pragma("omp parallel num_threads(threads)") {                                     \
            ENCODER_BUFFERS(SP, S, D)                                                      \
            if (!ok) {                                                                     \
                _Pragma("omp atomic write") failed = 1;                                    \
            }                                                                              \
            _Pragma("omp barrier");                                                        \
            int64_t packed = -1; /* the (b, h) whose keys and values the buffers hold */    \
            _Pragma("omp for schedule(static)")                                            \
            for (int64_t i = 0; i < (failed ? 0 : B * H * parts); i++) {                   \
                const int64_t bh = i / parts, b = bh / H, h = bh % H;                      \
                const T *qi = q + b * qs[0] + h * qs[1];                                   \
                T *oi = out + b * os[0] + h * os[1];                                       \
                if (bh != packed) {                                                        \
                    const T *ki = k + b * ks[0] + h * ks[1];                               \
                    const T *vi = v + b * vs[0] + h * vs[1];                               \
                    for (int64_t s = 0; s < SP; s++) { /* key s: column s % KEYS */        \
                        float *col = panels + s / KEYS * KEYS * D + s % KEYS;              \
                        if (s < S)                                                         \
                            for (int64_t d = 0; d < D; d++) col[d * KEYS] = LOAD(ki[s * ks[2] + d]); \
                        else                                                               \
                            for (int64_t d = 0; d < D; d++) col[d * KEYS] = 0.0f;          \
                    }                                                                      \
                    for (int64_t s = 0; s < S; s++)                                        \
                        for (int64_t d = 0; d < D; d++) values[s * D + d] = LOAD(vi[s * vs[2] + d]); \
                    packed = bh;                                                           \
                }                                                                          \
                const int64_t from = i % parts * per_part;                                 \
                const int64_t to = from + per_part < TQ ? from + per_part : TQ;            \
                for (int64_t t0 = from; t0 < to; t0 += ROWS) {                             \
                    const int64_t rows = to - t0 < ROWS ? to - t0 : ROWS; /* rest: zeros */ \
                    for (int64_t r = 0; r < ROWS; r++)                                     \
                        for (int64_t d = 0; d < D; d++)                                    \
                            query[r * D + d] =                                             \
                                r < rows ? LOAD(qi[(t0 + r) * qs[2] + d]) * scale : 0.0f;  \
                    tile_scores(query, panels, SP, D, scores);                             \
                    float total[ROWS];                                                     \
                    tile_softmax(scores, SP, S, total);                                    \
                    for (int64_t c = 0; c < D; c += KEYS) { /* 2 x LANES columns a pass */ \
                        if (D - c >= KEYS)                                                 \
                            weigh_values(scores, SP, values + c, S, D, total, tile + c, 2); \
                        else                                                               \
                            weigh_values(scores, SP, values + c, S, D, total, tile + c, 1); \
                    }                                                                      \
                    for (int64_t r = 0; r < rows; r++)                                     \
                        for (int64_t d = 0; d < D; d++)                                    \
                            oi[(t0 + r) * os[2] + d] = STORE(tile[r * D + d]);             \
                }                                                                          \
            }                                                                              \
            free(panels);                                                                  \
            free(values);                                                                  \
            free(scores);                                                                  \
            free(query);                                                                   \
            free(tile);                                                                    \
        }                                                                                  \
        return failed ? -1 : 0;                                                            \
    }

ENCODER_ATTENTION(encoder_attention_f32, float, as_float, as_float)
ENCODER_ATTENTION(encoder_attention_bf16, uint16_t, from_bf16, to_bf16)
