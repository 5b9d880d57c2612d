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
