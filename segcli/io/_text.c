/* Rows of numbers as text, from orjson's text of them, for `segcli.io.text`.

   orjson writes a flat float64 array as `[t0,t1,...]`, each number in the shortest digits
   that read back as it, in notation that differs from Python's repr in four ways, undone
   here in one pass: an integer's `12.0` loses `.0`; `null` (any non-finite value) becomes
   its spelling; a one-digit negative exponent gets its zero (`1.5e-7`, |x| in [1e-9, 1e-5),
   becomes `1.5e-07`); and |x| in [1e-5, 1e-4) goes from positional to scientific
   (`-0.0000123` becomes `-1.23e-05`). Number k of a row is followed by after[k] (the last,
   the row's end and the next row's start); the text starts with the first row's start. */

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

/* Bytes written into out (at most `room`, else -1) for the n = rows * cells numbers `values`
   of orjson's text `in` (n_in bytes). literals[offsets[j]..offsets[j + 1]) is, for j < cells,
   after[j]; for j = cells, the row's start; for j = cells + 1, + 2, + 3, the spelling of
   NaN, inf and -inf. is_int[k] marks integer columns. The last row's trailing start is left
   out. */
int64_t segcli_text(const char *in, int64_t n_in, const double *values, int64_t n,
                    int64_t cells, const uint8_t *is_int, const char *literals,
                    const int64_t *offsets, char *out, int64_t room) {
    const char *start = literals + offsets[cells];
    int64_t start_len = offsets[cells + 1] - offsets[cells];
    char *o = out, *end = out + room;
    const char *p = in + 1, *stop = in + n_in - 1;  /* inside the brackets */
    if (start_len > room) return -1;
    for (int64_t j = 0; j < start_len; j++) *o++ = start[j];
    for (int64_t i = 0, k = 0; i < n; i++) {
        if (end - o < stop - p + 9) return -1;  /* the rest, one byte more, eight to spare */
        char *first = o;
        copy_number(&p, &o, stop);
        p++;
        double v = values[i], a = fabs(v);
        if (!isfinite(v)) {  /* "null": its spelling */
            int s = isnan(v) ? 0 : v > 0 ? 1 : 2;
            int64_t from = offsets[cells + 1 + s], to = offsets[cells + 2 + s];
            o = first;
            if (end - o < to - from) return -1;
            for (int64_t j = from; j < to; j++) *o++ = literals[j];
        } else if (is_int[k]) {  /* "12.0": "12" */
            o -= 2;
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
        int64_t after = offsets[k + 1] - offsets[k];
        if (i == n - 1) after -= start_len;  /* no row after the last */
        if (end - o < after) return -1;
        for (int64_t j = 0; j < after; j++) *o++ = literals[offsets[k] + j];
        k = k + 1 == cells ? 0 : k + 1;
    }
    return o - out;
}
