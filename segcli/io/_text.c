/* Rows of numbers as text, for `segcli.io.text`: every number written as Python's repr writes
   it, with no Python (the caller lets go of Python's lock, so that threads write blocks of
   rows side by side).

   A float's digits are the shortest that read back as it, the closest to it of those, ties to
   an even last digit (Python's repr; Giulietti's Schubfach algorithm finds them), of the
   float64 or, for a float32 cell, of the float32 (what repr writes for the float64 that the
   float32's shortest text reads back as). Then repr's notation: positional where the decimal
   exponent x is in [-4, 16) (`0.0001`, `123.0`), else scientific with two exponent digits at
   least (`1e-05`, `1.5e+16`); zero as `0.0` or `-0.0`. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define K_MIN (-324) /* the first k of the table of powers of ten 10^-k (to 292) */
#define MASK_63 0x7fffffffffffffffull

/* floor(q log10 2), floor(q log10 (3/4 2)), floor(e log2 10), for the exponents of float64 */
static inline int64_t flog10pow2(int64_t q) { return (q * 661971961083LL) >> 41; }
static inline int64_t flog10threequarterspow2(int64_t q) {
    return (q * 661971961083LL - 274743187321LL) >> 41;
}
static inline int64_t flog2pow10(int64_t e) { return (e * 1741647) >> 19; }

/* floor(g cp / 2^127), its last bit set where the product has more bits: g = g1 2^63 + g0 */
static inline uint64_t rop(uint64_t g1, uint64_t g0, uint64_t cp) {
    unsigned __int128 x = (unsigned __int128)g0 * cp, y = (unsigned __int128)g1 * cp;
    uint64_t z = ((uint64_t)y >> 1) + (uint64_t)(x >> 64);
    return ((uint64_t)(y >> 64) + (z >> 63)) | (((z & MASK_63) + MASK_63) >> 63);
}

/* The shortest decimal *f 10^*e that rounds to c 2^q (c > 0, q >= q_min; the spacing below c
   is half that above where c is c_min and q > q_min), the closest of them, ties even.
   powers[2 (k - K_MIN)], [... + 1]: g1 and g0 of g = floor(10^-k 2^-r) + 1 in [2^125, 2^126). */
static inline void to_decimal(int64_t q, uint64_t c, uint64_t c_min, int64_t q_min,
                              const uint64_t *powers, uint64_t *f, int64_t *e) {
    uint64_t out = c & 1, cb = c << 2, cbr = cb + 2, cbl;
    int64_t k;
    if (c != c_min || q == q_min) {
        cbl = cb - 2;
        k = flog10pow2(q);
    } else {
        cbl = cb - 1;
        k = flog10threequarterspow2(q);
    }
    int64_t h = q + flog2pow10(-k) + 2;
    uint64_t g1 = powers[2 * (k - K_MIN)], g0 = powers[2 * (k - K_MIN) + 1];
    uint64_t vb = rop(g1, g0, cb << h), vbl = rop(g1, g0, cbl << h), vbr = rop(g1, g0, cbr << h);
    uint64_t s = vb >> 2;
    uint64_t sp10 = s / 10 * 10, tp10 = sp10 + 10;  /* a digit fewer: the multiples of 10 */
    int upin = vbl + out <= sp10 << 2, wpin = (tp10 << 2) + out <= vbr;
    if (upin != wpin) {
        *f = upin ? sp10 : tp10;
        *e = k;
        return;
    }
    uint64_t t = s + 1;
    int uin = vbl + out <= s << 2, win = (t << 2) + out <= vbr;
    if (uin != win) {
        *f = uin ? s : t;
    } else {
        int64_t cmp = (int64_t)(vb - ((s + t) << 1));
        *f = cmp < 0 || (cmp == 0 && (s & 1) == 0) ? s : t;
    }
    *e = k;
}

static const char PAIRS[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* The 8 digits of v < 10^8 at o, leading zeros included. */
static inline void put8(char *o, uint32_t v) {
    uint32_t a = v / 10000, b = v % 10000;
    memcpy(o, PAIRS + 2 * (a / 100), 2);
    memcpy(o + 2, PAIRS + 2 * (a % 100), 2);
    memcpy(o + 4, PAIRS + 2 * (b / 100), 2);
    memcpy(o + 6, PAIRS + 2 * (b % 100), 2);
}

/* The digits of v < 2^32 at o, no leading zero; how many (copies of a fixed size, so that
   they are inlined, write up to 10 bytes, some past them). */
static inline int put32(char *o, uint32_t v) {
    char d[20];
    int n = 0;
    while (v >= 100) {
        n += 2;
        memcpy(d + 10 - n, PAIRS + 2 * (v % 100), 2);
        v /= 100;
    }
    if (v >= 10) {
        n += 2;
        memcpy(d + 10 - n, PAIRS + 2 * v, 2);
    } else {
        d[10 - ++n] = (char)('0' + v);
    }
    memcpy(o, d + 10 - n, 10);
    return n;
}

/* The digits of f (any, up to 20) at o, no leading zero; how many. */
static inline int put_digits(char *o, uint64_t f) {
    if (f < 100000000) return put32(o, (uint32_t)f);
    uint64_t hi = f / 100000000;
    int n = hi < 100000000 ? put32(o, (uint32_t)hi)
                           : put32(o, (uint32_t)(hi / 100000000)) + 8;
    if (hi >= 100000000) put8(o + n - 8, (uint32_t)(hi % 100000000));
    put8(o + n, (uint32_t)(f % 100000000));
    return n + 8;
}

/* f 10^e (f > 0) in repr's notation at o; the end of it. Copies of fixed sizes (inlined)
   write up to 40 bytes, some past the end. */
static inline char *put_decimal(char *o, uint64_t f, int64_t e) {
    while (f % 10 == 0) {
        f /= 10;
        e++;
    }
    char d[48];
    int n = put_digits(d, f);
    int64_t x = e + n - 1;
    if (x >= 0 && x < 16) {
        memcpy(o, d, 16);
        if (n > x + 1) {  /* 12.5 */
            o[x + 1] = '.';
            memcpy(o + x + 2, d + x + 1, 16);
            return o + n + 1;
        }
        memset(o + n, '0', 16);  /* 1200.0 */
        memcpy(o + x + 1, ".0", 2);
        return o + x + 3;
    }
    if (x < 0 && x >= -4) {  /* 0.00125 */
        memcpy(o, "0.000", 5);
        memcpy(o + 1 - x, d, 17);
        return o + 1 - x + n;
    }
    o[0] = d[0];  /* 1.25e-07 */
    o[1] = '.';
    memcpy(o + 2, d + 1, 16);
    o += n > 1 ? n + 1 : 1;
    *o++ = 'e';
    *o++ = x < 0 ? '-' : '+';
    uint64_t a = (uint64_t)(x < 0 ? -x : x);
    if (a >= 100) *o++ = (char)('0' + a / 100);
    memcpy(o, PAIRS + 2 * (a % 100), 2);
    return o + 2;
}

/* The finite float64 v as repr writes it, or (single) the float32 it holds. */
static inline char *put_float(char *o, double v, int single, const uint64_t *powers) {
    uint64_t f;
    int64_t e;
    if (signbit(v)) *o++ = '-';
    if (v == 0) {
        memcpy(o, "0.0", 3);
        return o + 3;
    }
    uint64_t t, bq;  /* the trailing significand and the biased exponent */
    int significand, bias;
    if (single) {
        float w = (float)v;
        uint32_t bits;
        memcpy(&bits, &w, 4);
        significand = 23, bias = 150, t = bits & 0x7fffff, bq = (bits >> 23) & 0xff;
    } else {
        uint64_t bits;
        memcpy(&bits, &v, 8);
        significand = 52, bias = 1075, t = bits & ((1ull << 52) - 1), bq = bits >> 52 & 0x7ff;
    }
    uint64_t c_min = 1ull << significand;
    int64_t q_min = 1 - bias;  /* a subnormal's exponent, and the smallest normal's */
    to_decimal(bq ? (int64_t)bq - bias : q_min, bq ? t | c_min : t, c_min, q_min, powers, &f, &e);
    return put_decimal(o, f, e);
}

/* The decimal digits of v, signed, or with `unsigned_` the uint64 of its bits, at o; the end
   of them. */
static inline char *put_integer(char *o, int64_t v, int unsigned_) {
    uint64_t u = unsigned_ || v >= 0 ? (uint64_t)v : 0 - (uint64_t)v;
    if (!unsigned_ && v < 0) *o++ = '-';
    return o + put_digits(o, u);
}

/* Bytes written into out (at most `room`, else -1) for `rows` rows of `cells` numbers: cell
   k an integer (the next of `ints`) where kind[k] is 1 (3: the uint64 of its bits), else a float, the next of `floats`,
   of float64 (kind 0) or float32 (kind 2) values. literals[offsets[j]..offsets[j + 1]) is,
   for j < cells, the text after cell j (the last: the row's end and the next row's start);
   for j = cells, the row's start; for j = cells + 1, + 2, + 3, the spelling of NaN, inf and
   -inf. The last row's trailing start is left out. `powers`: see to_decimal. */
int64_t segcli_text(const double *floats, const int64_t *ints, int64_t rows, int64_t cells,
                    const uint8_t *kind, const char *literals, const int64_t *offsets,
                    const uint64_t *powers, char *out, int64_t room) {
    const char *start = literals + offsets[cells];
    int64_t start_len = offsets[cells + 1] - offsets[cells];
    int64_t longest = offsets[cells + 4] - offsets[cells + 1] + 64;  /* a number, its spare */
    char *o = out, *end = out + room;
    if (start_len > room) return -1;
    memcpy(o, start, start_len);
    o += start_len;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < cells; k++) {
            int64_t after = offsets[k + 1] - offsets[k];
            if (r == rows - 1 && k == cells - 1) after -= start_len;  /* no row after */
            if (end - o < longest + after) return -1;
            if (kind[k] & 1) {
                o = put_integer(o, *ints++, kind[k] == 3);
            } else {
                double v = *floats++;
                if (isfinite(v)) {
                    o = put_float(o, v, kind[k] == 2, powers);
                } else {
                    int s = isnan(v) ? 0 : v > 0 ? 1 : 2;
                    int64_t from = offsets[cells + 1 + s], to = offsets[cells + 2 + s];
                    memcpy(o, literals + from, to - from);
                    o += to - from;
                }
            }
            for (int64_t j = 0; j < after; j++) *o++ = literals[offsets[k] + j];
        }
    }
    return o - out;
}
