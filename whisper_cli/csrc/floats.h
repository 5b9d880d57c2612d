/* Loads and stores of the C kernels' element types, each computed in float32. */
#ifndef WHISPER_CLI_FLOATS_H
#define WHISPER_CLI_FLOATS_H

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

static inline float as_float(float x) { return x; }

#endif
