/* A site's secure_int8 passes over its update w_c * Delta_c: the announcement, then the masked codes.
 *
 * Both read one contiguous fp32 run x[0, n) of the flattened update, whose first element has global
 * index j0, so a caller walks the update tensor by tensor and chunk by chunk; a block may span runs.
 * For every element, with v = x[i] * w (one fp32 rounding, as torch's x * tensor(w)):
 *
 *   lens_weighted_absmax   absmax[b] = max(absmax[b], |v|)                 (b = (j0 + i) / block)
 *   lens_quantize_mask     q = clamp(rint(v / s_b), -127, 127)              (s_b = 0 divides by +inf)
 *                          y[i] = q + sum_p sign_p * ks_p[i]   mod 2^k       (k = 16 or 32)
 *
 * which is quant.py's `block_absmax` (zeros canonical +0) and `quantize_with_scales` followed by
 * secagg's `site_mask` / `mask_codes`, element for element: rint rounds half to even in the default
 * rounding mode, as torch's round_ does, the division is IEEE (not a reciprocal multiply), and
 * -ffp-contract=off keeps the multiply by w a separate rounding.
 *
 * Checks, in the same pass: |v| <= max_abs (false for NaN and Inf, so it covers finiteness) and, in
 * lens_quantize_mask, |v| <= announced[b]. A tile that fails returns its offset; the caller then runs
 * the eager checks to name the failure, and discards the partly written output. Returns -1 when
 * every element passed. ks_p are the pair keystreams for this run (little-endian ring elements);
 * y may be unaligned (it follows a payload header). C99 with GCC attributes, no Python API.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CTILE 4096 /* elements per tile: the mask accumulator stays in L1 */

typedef uint16_t __attribute__((aligned(1), may_alias)) u16_unaligned;
typedef uint32_t __attribute__((aligned(1), may_alias)) u32_unaligned;

/* The bits of |f|: for non-negative floats (NaN aside, which sorts above +Inf) integer order is float
 * order, so the max reduction below vectorizes as an integer max without fast-math. */
static inline uint32_t abs_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u & 0x7fffffffu;
}

/* One run of elements sharing a block: returns nonzero when an element fails a check. */
static int absmax_run(const float *restrict x, int64_t len, float w, float max_abs, float *restrict absmax) {
    const uint32_t limit = abs_bits(max_abs);
    uint32_t m = abs_bits(*absmax);
    int bad = 0;
    for (int64_t i = 0; i < len; ++i) {
        const uint32_t a = abs_bits(x[i] * w);
        bad |= a > limit; /* |v| > max_abs, Inf or NaN */
        m = a > m ? a : m;
    }
    memcpy(absmax, &m, 4);
    return bad;
}

int64_t lens_weighted_absmax(const float *x, int64_t n, int64_t j0, float w, int64_t block, float max_abs,
                             float *absmax_B) {
    for (int64_t i0 = 0; i0 < n; i0 += CTILE) {
        const int64_t len = n - i0 < CTILE ? n - i0 : CTILE;
        int bad = 0;
        for (int64_t i = i0; i < i0 + len;) {
            const int64_t b = (j0 + i) / block;
            int64_t end = (b + 1) * block - j0;
            if (end > i0 + len) end = i0 + len;
            bad |= absmax_run(x + i, end - i, w, max_abs, absmax_B + b);
            i = end;
        }
        if (bad) return i0;
    }
    return -1;
}

/* Codes of one run sharing a block, as int32 into q; nonzero when an element fails a check. */
static int quantize_run(const float *restrict x, int64_t len, float w, float s, float max_abs, float announced,
                        int32_t *restrict q) {
    const float divisor = s > 0.0f ? s : INFINITY;
    int bad = 0;
    for (int64_t i = 0; i < len; ++i) {
        const float v = x[i] * w;
        const float a = fabsf(v);
        bad |= !(a <= max_abs) | !(a <= announced);
        float r = rintf(v / divisor);
        r = r < -127.0f ? -127.0f : r;
        r = r > 127.0f ? 127.0f : r;
        q[i] = (int32_t)r;
    }
    return bad;
}

int64_t lens_quantize_mask(const float *x, int64_t n, int64_t j0, float w, int64_t block, const float *scales_B,
                           const float *announced_B, float max_abs, const unsigned char *const *ks,
                           const int32_t *adds, int32_t num_peers, int32_t ring_bits, unsigned char *y) {
    int32_t q[CTILE];
    for (int64_t i0 = 0; i0 < n; i0 += CTILE) {
        const int64_t len = n - i0 < CTILE ? n - i0 : CTILE;
        int bad = 0;
        for (int64_t i = i0; i < i0 + len;) {
            const int64_t b = (j0 + i) / block;
            int64_t end = (b + 1) * block - j0;
            if (end > i0 + len) end = i0 + len;
            bad |= quantize_run(x + i, end - i, w, scales_B[b], max_abs, announced_B[b], q + (i - i0));
            i = end;
        }
        if (bad) return i0;
        if (ring_bits == 16) {
            uint16_t acc[CTILE];
            for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)q[i];
            for (int32_t p = 0; p < num_peers; ++p) {
                const u16_unaligned *k = (const u16_unaligned *)(ks[p] + 2 * i0);
                if (adds[p]) {
                    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(acc[i] + k[i]);
                } else {
                    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(acc[i] - k[i]);
                }
            }
            u16_unaligned *out = (u16_unaligned *)(y + 2 * i0);
            for (int64_t i = 0; i < len; ++i) out[i] = acc[i];
        } else {
            uint32_t acc[CTILE];
            for (int64_t i = 0; i < len; ++i) acc[i] = (uint32_t)q[i];
            for (int32_t p = 0; p < num_peers; ++p) {
                const u32_unaligned *k = (const u32_unaligned *)(ks[p] + 4 * i0);
                if (adds[p]) {
                    for (int64_t i = 0; i < len; ++i) acc[i] += k[i];
                } else {
                    for (int64_t i = 0; i < len; ++i) acc[i] -= k[i];
                }
            }
            u32_unaligned *out = (u32_unaligned *)(y + 4 * i0);
            for (int64_t i = 0; i < len; ++i) out[i] = acc[i];
        }
    }
    return -1;
}
