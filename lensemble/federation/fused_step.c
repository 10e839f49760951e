/* The aggregator's fused secure_int8 (k = 16) round on one slice, in one pass over memory.
 *
 * For i in [0, n), with j = start + i:
 *   t    = sum_c y_c[j] mod 2^16                 (exact ring sum; the masks cancel)
 *   d    = (float)(int16)t * scales[j / block]   (one rounding; exact in fp64, see secure_transport)
 *   buf' = m[i] * mom - d                        (two roundings, as torch's mul_ then add_;
 *          or -d on the first step)               -ffp-contract=off keeps them separate)
 *   r    = d - mom * buf'                        (fmaf when torch fuses add(alpha), else two roundings)
 *   p'   = p[i] + lr * r                         (likewise)
 * which is outer.py's eager `_step_chunk`, element for element. Bodies are the verified payload
 * bodies (little-endian uint16, possibly unaligned). C99 with GCC attributes, no Python API.
 *
 * Self-check (INV-AGG-DETERMINISM): each tile of TILE elements is evaluated twice while its inputs sit
 * in L1/L2, and the two results are compared bit for bit; the second evaluation goes through a
 * volatile function pointer so the compiler cannot fold it into the first. `lens_fault_at` is a
 * fault-injection hook for tests: when it equals a tile's start, the re-evaluation is perturbed.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 4096 /* elements per tile: the ring sum's accumulator stays in L1 */

typedef uint16_t __attribute__((aligned(1), may_alias)) u16_unaligned; /* payload bodies follow a header */

/* acc += src in Z_{2^16}. */
__attribute__((noinline)) static void ring_add(uint16_t *restrict acc, const u16_unaligned *restrict src, int64_t len) {
    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(acc[i] + src[i]);
}

/* acc += a + b in Z_{2^16}. */
__attribute__((noinline)) static void ring_add2(uint16_t *restrict acc, const u16_unaligned *restrict a, const u16_unaligned *restrict b,
                                                int64_t len) {
    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(acc[i] + a[i] + b[i]);
}

/* acc = a + b + c + d in Z_{2^16}. */
__attribute__((noinline)) static void ring_set4(uint16_t *restrict acc, const u16_unaligned *restrict a, const u16_unaligned *restrict b,
                                                const u16_unaligned *restrict c, const u16_unaligned *restrict d, int64_t len) {
    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(a[i] + b[i] + c[i] + d[i]);
}

/* acc += a + b + c + d in Z_{2^16}. */
__attribute__((noinline)) static void ring_add4(uint16_t *restrict acc, const u16_unaligned *restrict a, const u16_unaligned *restrict b,
                                                const u16_unaligned *restrict c, const u16_unaligned *restrict d, int64_t len) {
    for (int64_t i = 0; i < len; ++i) acc[i] = (uint16_t)(acc[i] + a[i] + b[i] + c[i] + d[i]);
}

#define BODY(c) ((const u16_unaligned *)(bodies[(c)] + 2 * j0))

/* acc = sum over the sites of their bodies' elements [j0, j0 + len) in Z_{2^16} (exact, so any grouping gives
 * the same bits). Up to four bodies a pass: the memory system streams several at once, and the accumulator
 * is rewritten about C/4 times rather than C - 1 (8 sites: 30% less time than one body a pass). */
static void ring_sum(uint16_t *restrict acc, const unsigned char *const *bodies, int32_t num_sites, int64_t j0, int64_t len) {
    int32_t c = 4;
    if (num_sites >= 4) {
        ring_set4(acc, BODY(0), BODY(1), BODY(2), BODY(3), len);
    } else {
        memcpy(acc, bodies[0] + 2 * j0, (size_t)(2 * len));
        c = 1;
    }
    for (; c + 4 <= num_sites; c += 4) ring_add4(acc, BODY(c), BODY(c + 1), BODY(c + 2), BODY(c + 3), len);
    for (; c + 2 <= num_sites; c += 2) ring_add2(acc, BODY(c), BODY(c + 1), len);
    if (c < num_sites) ring_add(acc, BODY(c), len);
}

/* One run of elements sharing a scale: the float part of the step. */
__attribute__((noinline)) static void step_run(const uint16_t *restrict t, float s, const float *restrict p, const float *restrict m, float mom,
                     float lr, int32_t fused, float *restrict new_p, float *restrict new_m, int64_t len) {
    for (int64_t i = 0; i < len; ++i) {
        const float d = (float)(int16_t)t[i] * s;
        const float b = m ? m[i] * mom - d : -d;
        float q;
        if (fused) {
            q = fmaf(lr, fmaf(-mom, b, d), p[i]);
        } else {
            q = p[i] + lr * (d - mom * b);
        }
        new_m[i] = b;
        new_p[i] = q;
    }
}

/* One tile: ring sum over the sites, then the step, run by run of one quantization block. */
static void step_tile(const unsigned char *const *bodies, int32_t num_sites, int64_t j0, int64_t len,
                      const float *scales, int64_t block, const float *p, const float *m, float mom, float lr,
                      int32_t fused, float *new_p, float *new_m) {
    uint16_t acc[TILE];
    ring_sum(acc, bodies, num_sites, j0, len);
    for (int64_t i = 0; i < len;) {
        const int64_t b = (j0 + i) / block;
        int64_t end = (b + 1) * block - j0;
        if (end > len) end = len;
        step_run(acc + i, scales[b], p + i, m ? m + i : 0, mom, lr, fused, new_p + i, new_m + i, end - i);
        i = end;
    }
}

volatile int64_t lens_fault_at = -1;

/* Called through a volatile pointer for the re-evaluation, so the compiler cannot merge the two. */
static void (*volatile step_tile_again)(const unsigned char *const *, int32_t, int64_t, int64_t, const float *, int64_t,
                                        const float *, const float *, float, float, int32_t, float *, float *) = step_tile;

/* The step on elements [start, start + n); every tile is evaluated twice while it sits in L1/L2 and the
 * results are compared bit for bit (INV-AGG-DETERMINISM). Returns -1, or the offset of the first tile
 * whose two evaluations differ (new_p/new_m are then partly written; the caller discards them). */
int64_t lens_secure16_step(const unsigned char *const *bodies, int32_t num_sites, int64_t start, int64_t n,
                           const float *scales, int64_t block, const float *p, const float *m, float mom, float lr,
                           int32_t fused, float *new_p, float *new_m) {
    float check_p[TILE], check_m[TILE];
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t len = n - i0 < TILE ? n - i0 : TILE;
        const float *m_tile = m ? m + i0 : 0;
        step_tile(bodies, num_sites, start + i0, len, scales, block, p + i0, m_tile, mom, lr, fused, new_p + i0, new_m + i0);
        step_tile_again(bodies, num_sites, start + i0, len, scales, block, p + i0, m_tile, mom, lr, fused, check_p, check_m);
        if (lens_fault_at == start + i0) check_p[len - 1] = nextafterf(check_p[len - 1], INFINITY);
        if (memcmp(check_p, new_p + i0, (size_t)len * 4) != 0 || memcmp(check_m, new_m + i0, (size_t)len * 4) != 0) return i0;
    }
    return -1;
}
