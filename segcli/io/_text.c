/* Rows of numbers as text, for `segcli.io.text`: integers written here, floats from orjson's
   text of them.

   orjson writes a flat float64 array as `[t0,t1,...]`, each number in the shortest digits
   that read back as it, in notation that differs from Python's repr in three ways, undone
   here in one pass: `null` (any non-finite value) becomes its spelling; a one-digit negative
   exponent gets its zero (`1.5e-7`, |x| in [1e-9, 1e-5), becomes `1.5e-07`); and |x| in
   [1e-5, 1e-4) goes from positional to scientific (`-0.0000123` becomes `-1.23e-05`). Number
   k of a row is followed by after[k] (the last, the row's end and the next row's start); the
   text starts with the first row's start. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The number at *p (up to the next comma, or to `stop`) copied to *o, both moved past it:
   eight bytes at a time where eight are there to read (a comma found among them as a zero
   byte of their XOR with commas), out having eight bytes to spare. */
static inline void copy_number(const char **p, char **o, const char *stop) {
    const char *from = *p;
    char *to = *o;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const uint64_t commas = 0x2c2c2c2c2c2c2c2cull, ones = 0x0101010101010101ull;
    while (stop - from >= 8) {
        uint64_t word, x, zero;
        memcpy(&word, from, 8);
        memcpy(to, &word, 8);
        x = word ^ commas;
        zero = (x - ones) & ~x & (ones << 7);
        if (zero) {
            int at = __builtin_ctzll(zero) >> 3;
            *p = from + at;
            *o = to + at;
            return;
        }
        from += 8;
        to += 8;
    }
#endif
    while (from < stop && *from != ',') *to++ = *from++;
    *p = from;
    *o = to;
}

/* The decimal digits of v (|v| < 2^63) at o; the end of them. */
static inline char *put_integer(char *o, int64_t v) {
    char digits[20];
    int n = 0;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    if (v < 0) *o++ = '-';
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    while (n) *o++ = digits[--n];
    return o;
}

/* Bytes written into out (at most `room`, else -1) for `rows` rows of `cells` numbers: cell
   k an integer (the next of `ints`) where is_int[k], else a float, the next of `floats`,
   whose text is the next number of orjson's `in` (n_in bytes). literals[offsets[j]..offsets[j
   + 1]) is, for j < cells, after[j]; for j = cells, the row's start; for j = cells + 1, + 2,
   + 3, the spelling of NaN, inf and -inf. The last row's trailing start is left out. */
int64_t segcli_text(const char *in, int64_t n_in, const double *floats, const int64_t *ints,
                    int64_t rows, int64_t cells, const uint8_t *is_int, const char *literals,
                    const int64_t *offsets, char *out, int64_t room) {
    const char *start = literals + offsets[cells];
    int64_t start_len = offsets[cells + 1] - offsets[cells];
    char *o = out, *end = out + room;
    const char *p = in + 1, *stop = in + n_in - 1;  /* inside the brackets */
    if (start_len > room) return -1;
    for (int64_t j = 0; j < start_len; j++) *o++ = start[j];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < cells; k++) {
            if (end - o < (stop - p) + 9 + 20) return -1;  /* a number, eight bytes spare */
            if (is_int[k]) {
                o = put_integer(o, *ints++);
            } else {
                char *first = o;
                double v = *floats++, a = fabs(v);
                copy_number(&p, &o, stop);
                p++;
                if (!isfinite(v)) {  /* "null": its spelling */
                    int s = isnan(v) ? 0 : v > 0 ? 1 : 2;
                    int64_t from = offsets[cells + 1 + s], to = offsets[cells + 2 + s];
                    o = first;
                    for (int64_t j = from; j < to; j++) *o++ = literals[j];
                } else if (a < 1e-5 && a >= 1e-9) {  /* "1.5e-7": "1.5e-07" */
                    o[0] = o[-1];
                    o[-1] = '0';
                    o++;
                } else if (a < 1e-4 && a >= 1e-5) {  /* "0.0000123": "1.23e-05" */
                    char *d = first + (*first == '-'), *digits = d + 6;  /* after "0.0000" */
                    int64_t more = o - digits - 1;  /* digits after the first */
                    *d++ = digits[0];
                    if (more > 0) {
                        *d++ = '.';
                        memmove(d, digits + 1, more);
                        d += more;
                    }
                    memcpy(d, "e-05", 4);
                    o = d + 4;
                }
            }
            int64_t after = offsets[k + 1] - offsets[k];
            if (r == rows - 1 && k == cells - 1) after -= start_len;  /* no row after */
            if (end - o < after) return -1;
            for (int64_t j = 0; j < after; j++) *o++ = literals[offsets[k] + j];
        }
    }
    return o - out;
}
