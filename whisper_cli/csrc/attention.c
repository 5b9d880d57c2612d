/* One decode step's attention over bf16 keys and values, computed in float32.
 *
 * out[b, h] = softmax(q[b, h] . k[b, h]^T * scale) . v[b, h], one query per (b, h): what
 * kernels._attend_f32 computes, each key and value widened to float32 as it is read
 * instead of through a float32 copy of the cache. A decode step on the CPU is bound by
 * reading its cross-attention cache; the copy wrote it again in float32 and read that.
 *
 * Strides are in elements (q, out: batch, head; k, v: batch, head, key); the last
 * dimension of every tensor is contiguous. Built by whisper_cli/native.py with
 * -ffast-math, which lets the dot products and exp vectorize: nothing here is NaN or
 * infinite (the scores of finite inputs are finite), and the order of a float32 sum is
 * no part of the result's contract (see kernels.py: as exact as the reference).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch rounds */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           uint16_t *out, int64_t B, int64_t H, int64_t S, int64_t D,
                           const int64_t *qs, const int64_t *ks, const int64_t *vs,
                           const int64_t *os, float scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < B * H; i++) {
        const int64_t b = i / H, h = i % H;
        const uint16_t *qi = q + b * qs[0] + h * qs[1];
        const uint16_t *ki = k + b * ks[0] + h * ks[1];
        const uint16_t *vi = v + b * vs[0] + h * vs[1];
        float qf[D], acc[D], p[S]; /* D <= 256, S <= 4096: native.py checks */
        for (int64_t d = 0; d < D; d++) qf[d] = from_bf16(qi[d]) * scale;
        for (int64_t s = 0; s < S; s++) {
            const uint16_t *row = ki + s * ks[2];
            float dot = 0.0f;
            for (int64_t d = 0; d < D; d++) dot += qf[d] * from_bf16(row[d]);
            p[s] = dot;
        }
        float top = p[0];
        for (int64_t s = 1; s < S; s++) top = p[s] > top ? p[s] : top;
        float total = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            p[s] = expf(p[s] - top);
            total += p[s];
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            const uint16_t *row = vi + s * vs[2];
            for (int64_t d = 0; d < D; d++) acc[d] += p[s] * from_bf16(row[d]);
        }
        uint16_t *o = out + b * os[0] + h * os[1];
        for (int64_t d = 0; d < D; d++) o[d] = to_bf16(acc[d] / total);
    }
}
