/* What a file's bytes may encode as text, for the leak scan (lensemble/data/audit.py).
 *
 * The same results as audit.py's regular-expression reference (`_text_numbers`, and the base64 and hex
 * runs of `_decoded`), bit for bit, in one pass over the bytes instead of a Python call per match:
 *
 * - numbers: the leftmost non-overlapping matches of  -?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?  as
 *   doubles (strtod: correctly rounded, as Python's float()), and the runs (>= 8) of consecutive matches
 *   that are plain integers 0..255, as bytes;
 * - base64: maximal runs of [A-Za-z0-9+/] at least 11 long, decoded as binascii.a2b_base64 does after
 *   `base64.b64decode` pads them (a run of 4k+1 characters is an error there: no part);
 * - hex: maximal runs of [0-9a-fA-F] at least 16 long, their first 2*floor(len/2) characters decoded.
 *
 * Each kind's parts come out joined by 8 zero bytes, as the scan joins them. Every function is called
 * twice: with null outputs it returns the sizes, then fills buffers of those sizes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SEP 8 /* zero bytes between parts */

static inline int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* The next number at or after *pos: [*start, *end), *plain when it is digits only. 0 at the end. */
static int next_number(const uint8_t *d, int64_t n, int64_t *pos, int64_t *start, int64_t *end, int *plain) {
    for (int64_t p = *pos; p < n; p++) {
        int64_t q = p, m;
        if (d[p] == '-')
            q = p + 1;
        else if (!is_digit(d[p]) && d[p] != '.')
            continue;
        if (q >= n)
            continue;
        int is_plain = q == p;
        if (is_digit(d[q])) {
            m = q;
            while (m < n && is_digit(d[m])) m++;
            if (m < n && d[m] == '.') {
                is_plain = 0;
                m++;
                while (m < n && is_digit(d[m])) m++;
            }
        } else if (d[q] == '.' && q + 1 < n && is_digit(d[q + 1])) {
            is_plain = 0;
            m = q + 1;
            while (m < n && is_digit(d[m])) m++;
        } else {
            continue; /* '-' or '.' not followed by a number here */
        }
        if (m < n && (d[m] == 'e' || d[m] == 'E')) {
            int64_t x = m + 1;
            if (x < n && (d[x] == '+' || d[x] == '-')) x++;
            if (x < n && is_digit(d[x])) {
                while (x < n && is_digit(d[x])) x++;
                m = x;
                is_plain = 0;
            }
        }
        *start = p;
        *end = m;
        *plain = is_plain;
        *pos = m;
        return 1;
    }
    *pos = n;
    return 0;
}

/* A plain integer's value if it is at most 255, else -1. */
static int small_int(const uint8_t *s, int64_t len) {
    int64_t i = 0;
    while (i < len - 1 && s[i] == '0') i++;
    if (len - i > 3) return -1;
    int v = 0;
    for (; i < len; i++) v = v * 10 + (s[i] - '0');
    return v <= 255 ? v : -1;
}

int lens_alloc_failed = 0; /* set when a long number's buffer could not be allocated (its value then reads 0) */

static double parse_double(const uint8_t *s, int64_t len) {
    char small[128];
    char *buf = len < (int64_t)sizeof small ? small : malloc((size_t)len + 1);
    if (buf == NULL) {
        lens_alloc_failed = 1;
        return 0.0;
    }
    memcpy(buf, s, (size_t)len);
    buf[len] = 0;
    double x = strtod(buf, NULL);
    if (buf != small) free(buf);
    return x;
}

/* Numbers: returns their count and fills nums when non-null (its size from a first call); *runs_size is the
 * size of the joined small-integer runs (lens_text_runs writes them), *runs_count how many there are. */
int64_t lens_text_numbers(const uint8_t *d, int64_t n, double *nums, int64_t *runs_size, int64_t *runs_count) {
    int64_t pos = 0, start, end, count = 0, size = 0, nruns = 0, run_len = 0;
    int plain;
    while (next_number(d, n, &pos, &start, &end, &plain)) {
        if (nums != NULL) nums[count] = parse_double(d + start, end - start);
        count++;
        if (plain && small_int(d + start, end - start) >= 0) {
            run_len++;
            continue;
        }
        if (run_len >= 8) {
            size += (nruns > 0 ? SEP : 0) + run_len;
            nruns++;
        }
        run_len = 0;
    }
    if (run_len >= 8) {
        size += (nruns > 0 ? SEP : 0) + run_len;
        nruns++;
    }
    *runs_size = size;
    *runs_count = nruns;
    return count;
}

/* The joined small-integer runs (size from lens_text_numbers) written into out. */
void lens_text_runs(const uint8_t *d, int64_t n, uint8_t *out) {
    int64_t pos = 0, start, end, nruns = 0, run_len = 0;
    int plain;
    uint8_t run[8]; /* the first 8 values of a run, held until it is long enough to be one */
    uint8_t *w = out;
    while (next_number(d, n, &pos, &start, &end, &plain)) {
        int v = plain ? small_int(d + start, end - start) : -1;
        if (v >= 0) {
            if (run_len < 8) {
                run[run_len] = (uint8_t)v;
                if (run_len == 7) {
                    if (nruns > 0) { memset(w, 0, SEP); w += SEP; }
                    memcpy(w, run, 8);
                    w += 8;
                    nruns++;
                }
            } else {
                *w++ = (uint8_t)v;
            }
            run_len++;
            continue;
        }
        run_len = 0;
    }
}

static const int8_t B64[256] = {
    ['A'] = 1,  ['B'] = 2,  ['C'] = 3,  ['D'] = 4,  ['E'] = 5,  ['F'] = 6,  ['G'] = 7,  ['H'] = 8,  ['I'] = 9,
    ['J'] = 10, ['K'] = 11, ['L'] = 12, ['M'] = 13, ['N'] = 14, ['O'] = 15, ['P'] = 16, ['Q'] = 17, ['R'] = 18,
    ['S'] = 19, ['T'] = 20, ['U'] = 21, ['V'] = 22, ['W'] = 23, ['X'] = 24, ['Y'] = 25, ['Z'] = 26, ['a'] = 27,
    ['b'] = 28, ['c'] = 29, ['d'] = 30, ['e'] = 31, ['f'] = 32, ['g'] = 33, ['h'] = 34, ['i'] = 35, ['j'] = 36,
    ['k'] = 37, ['l'] = 38, ['m'] = 39, ['n'] = 40, ['o'] = 41, ['p'] = 42, ['q'] = 43, ['r'] = 44, ['s'] = 45,
    ['t'] = 46, ['u'] = 47, ['v'] = 48, ['w'] = 49, ['x'] = 50, ['y'] = 51, ['z'] = 52, ['0'] = 53, ['1'] = 54,
    ['2'] = 55, ['3'] = 56, ['4'] = 57, ['5'] = 58, ['6'] = 59, ['7'] = 60, ['8'] = 61, ['9'] = 62, ['+'] = 63,
    ['/'] = 64,
}; /* value + 1; 0: not in the alphabet */

/* Decoded base64 runs joined by SEP zero bytes: returns the joined size, *parts the count; fills out if non-null. */
int64_t lens_base64_parts(const uint8_t *d, int64_t n, uint8_t *out, int64_t *parts) {
    int64_t p = 0, size = 0, count = 0;
    uint8_t *w = out;
    while (p < n) {
        if (!B64[d[p]]) { p++; continue; }
        int64_t s = p;
        while (p < n && B64[d[p]]) p++;
        int64_t len = p - s;
        if (len < 11 || len % 4 == 1) continue; /* no match, or b64decode raises */
        int64_t bytes = 3 * (len / 4) + (len % 4 == 2 ? 1 : len % 4 == 3 ? 2 : 0);
        if (w != NULL) {
            if (count > 0) { memset(w, 0, SEP); w += SEP; }
            uint32_t left = 0;
            for (int64_t i = 0; i < len; i++) {
                uint32_t v = (uint32_t)(B64[d[s + i]] - 1);
                switch (i & 3) {
                case 0: left = v; break;
                case 1: *w++ = (uint8_t)((left << 2) | (v >> 4)); left = v & 0x0f; break;
                case 2: *w++ = (uint8_t)((left << 4) | (v >> 2)); left = v & 0x03; break;
                default: *w++ = (uint8_t)((left << 6) | v); left = 0; break;
                }
            }
        }
        size += (count > 0 ? SEP : 0) + bytes;
        count++;
    }
    *parts = count;
    return size;
}

static inline int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decoded hex runs joined by SEP zero bytes: returns the joined size, *parts the count; fills out if non-null. */
int64_t lens_hex_parts(const uint8_t *d, int64_t n, uint8_t *out, int64_t *parts) {
    int64_t p = 0, size = 0, count = 0;
    uint8_t *w = out;
    while (p < n) {
        if (hex_value(d[p]) < 0) { p++; continue; }
        int64_t s = p;
        while (p < n && hex_value(d[p]) >= 0) p++;
        int64_t len = p - s;
        if (len < 16) continue;
        if (w != NULL) {
            if (count > 0) { memset(w, 0, SEP); w += SEP; }
            for (int64_t i = 0; i + 1 < len; i += 2) *w++ = (uint8_t)(hex_value(d[s + i]) << 4 | hex_value(d[s + i + 1]));
        }
        size += (count > 0 ? SEP : 0) + len / 2;
        count++;
    }
    *parts = count;
    return size;
}

/* Byte offsets p (ascending) whose little-endian 8-byte word w = d[p..p+7] has its bitmap slot set,
 * slot = (w * 0x9E3779B97F4A7C15) >> (64 - bits): audit.py's `_candidates` pre-filter at every offset.
 * Writes at most cap offsets; returns how many there are (more than cap: call again with room for them). */
int64_t lens_word_candidates(const uint8_t *d, int64_t n, const uint8_t *bitmap, int32_t bits, int64_t *out, int64_t cap) {
    int64_t count = 0;
    const uint32_t shift = 64 - (uint32_t)bits;
    for (int64_t p = 0; p + 8 <= n; p++) {
        uint64_t w;
        memcpy(&w, d + p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        if (bitmap[(w * 0x9E3779B97F4A7C15ull) >> shift]) {
            if (count < cap) out[count] = p;
            count++;
        }
    }
    return count;
}
