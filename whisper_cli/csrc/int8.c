/* The float work around an int8 GEMM (kernels._int8_onednn, _int8_fbgemm), each in one
 * pass over its rows instead of torch's chain of elementwise calls (the product of a few
 * rows with an int8 weight itself is matmul.c's).
 *
 * unit_rows_*: x (M, K) rows (float32 or bfloat16, row stride ld) -> unit (M, K) float32,
 * contiguous, each row divided by a = max |x[i, :]| (1 where the row is all zero), and
 * amax (M,) = a: kernels._unit_rows, in the same float32 operations.
 *
 * quantize_rows_*: x (M, K) rows (float32 or bfloat16, row stride ld) -> q (M, K) uint8,
 * contiguous, and amax (M,) float32, each row quantized on its own fixed grid, whose
 * steps and zero the caller passes (kernels.Grid, see activation_grid; the unit rows
 * take none):
 *     a = max |x[i, :]| (1 where the row is all zero),
 *     q[i, j] = round_half_even((x[i, j] / a) * steps) + zero,
 * the float32 operations torch performs for kernels._unit_rows and the grid, in the same
 * order, each rounded as torch rounds it: the same bytes (test_kernels asserts it).
 *
 * rescale_rows_*: acc (M, N) float32, contiguous -> out (M, N) (float32 or bfloat16, row
 * stride ld): out[i, j] = acc[i, j] * amax[i] (+ bias[j], in out's dtype, widened to
 * float32 as it is read), rounded once to out's dtype, as kernels._rescale computes it
 * with torch.mul / torch.addcmul (whose x86 kernel fuses the multiply-add: fmaf here,
 * one rounding).
 *
 * Built by native.py WITHOUT -ffast-math and with -ffp-contract=off: no reciprocal for
 * the division, no fused multiply-add but the one written, every operation rounded as
 * written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "floats.h"

static inline uint32_t abs_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x7fffffffu;
}

/* Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude below 2^22 to an
 * integer, half to even (the default rounding mode), as torch.round does. */
#define ROUNDER 12582912.0f

/* |x| compared as the bits of a non-negative float32 (their order is the numbers'):
 * an integer maximum, which vectorizes without -ffast-math. */
static inline float row_max(uint32_t top) {
    float a;
    memcpy(&a, &top, sizeof a);
    return a > 0.0f ? a : 1.0f; /* 1 for an all-zero row */
}

/* Each row's values divided by its maximum |x| (a float32 unit row), stored by STORE:
 * the unit row itself (fbgemm's input), or its point on the grid as uint8 (oneDNN's). */
#define ROWS(NAME, T, LOAD, OUT, STORE, PARAMS)                                           \
    void NAME(const T *x, int64_t M, int64_t K, int64_t ld, OUT *y, float *amax,           \
              PARAMS int threads) {                                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t i = 0; i < M; i++) {                                                  \
            const T *row = x + i * ld;                                                     \
            OUT *yi = y + i * K;                                                           \
            uint32_t top = 0;                                                              \
            for (int64_t j = 0; j < K; j++) {                                              \
                const uint32_t b = abs_bits(LOAD(row[j]));                                 \
                top = b > top ? b : top;                                                   \
            }                                                                              \
            const float a = row_max(top);                                                  \
            amax[i] = a;                                                                   \
            for (int64_t j = 0; j < K; j++) yi[j] = STORE(LOAD(row[j]) / a);               \
        }                                                                                  \
    }

static inline float unit(float u) { return u; }

static inline uint8_t on_grid(float u, float steps, float zero) {
    const float v = u * steps;
    const float r = (v + ROUNDER) - ROUNDER;
    return (uint8_t)(int32_t)(r + zero);
}

/* The unit rows take no more parameters; the quantized rows take their grid. */
#define NO_PARAMS
#define GRID_PARAMS float steps, float zero,
#define ON_GRID(u) on_grid((u), steps, zero)
ROWS(unit_rows_f32, float, as_float, float, unit, NO_PARAMS)
ROWS(unit_rows_bf16, uint16_t, from_bf16, float, unit, NO_PARAMS)
ROWS(quantize_rows_f32, float, as_float, uint8_t, ON_GRID, GRID_PARAMS)
ROWS(quantize_rows_bf16, uint16_t, from_bf16, uint8_t, ON_GRID, GRID_PARAMS)

#define RESCALE_ROWS(NAME, T, LOAD, STORE)                                                \
    void NAME(const float *acc, int64_t M, int64_t N, const float *amax, const T *bias,    \
              T *out, int64_t ld, int threads) {                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                  \
        for (int64_t i = 0; i < M; i++) {                                                  \
            const float *ai = acc + i * N;                                                 \
            const float s = amax[i];                                                       \
            T *oi = out + i * ld;                                                          \
            if (bias)                                                                      \
                for (int64_t j = 0; j < N; j++)                                            \
                    oi[j] = STORE(fmaf(ai[j], s, LOAD(bias[j])));                          \
            else                                                                           \
                for (int64_t j = 0; j < N; j++) oi[j] = STORE(ai[j] * s);                  \
        }                                                                                  \
    }

RESCALE_ROWS(rescale_rows_f32, float, as_float, as_float)
RESCALE_ROWS(rescale_rows_bf16, uint16_t, from_bf16, to_bf16)
