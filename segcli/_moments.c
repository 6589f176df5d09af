/* The moments of a chunk's rows, leaf by leaf and group by group, for `segcli.stats`.

   Rows (n, k) of float64 or float32 lie in consecutive leaves of `runs` rows each; row i is
   in group labels[i] (all in group 0 without labels; unsigned integers of 1, 2, 4 or 8 bytes,
   such as the atomic numbers as a file stores them, each checked to be a group). Each leaf is
   reduced on its own, in blocks of `block` rows from its first (fewer for a wide field; the
   last, the rest). A block's rows are put in group order (stably) as float64 columns, a
   vector field's norms (√Σ x², summed in the order of the components) last. Each group's run
   of each column gives a count, min and max, then a mean (its sum over its count) and an M2
   (the sum of squared deviations from that mean), each sum in LANES chains (row i of the run
   in chain i % LANES: a vector's lanes) added in order at the end. The blocks are merged into
   the leaf in order by Chan, Golub and LeVeque's pairwise formulas. The order of every
   operation is fixed by the rows alone, so a leaf's moments do not depend on what else is in
   the chunk, nor on the machine: built with -ffp-contract=off, no operation is fused, and
   each one is IEEE 754's (the AVX2 clone of segcli_moments runs the same operations, wider
   where they are independent). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define BLOCK_VALUES 65536  /* values of a block's columns, at most (fewer rows if wide) */
#define WIDE 4              /* columns reduced side by side */

#define LANES 2
typedef double lanes __attribute__((vector_size(8 * LANES)));
#define INLINE static inline __attribute__((always_inline))

INLINE lanes load(const double *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a < b ? a : b and a > b ? a : b, lane by lane (SSE2's minpd and maxpd). */
INLINE lanes smaller(lanes a, lanes b) {
#ifdef __SSE2__
    return (lanes)_mm_min_pd((__m128d)a, (__m128d)b);
#else
    return (lanes){a[0] < b[0] ? a[0] : b[0], a[1] < b[1] ? a[1] : b[1]};
#endif
}

INLINE lanes larger(lanes a, lanes b) {
#ifdef __SSE2__
    return (lanes)_mm_max_pd((__m128d)a, (__m128d)b);
#else
    return (lanes){a[0] > b[0] ? a[0] : b[0], a[1] > b[1] ? a[1] : b[1]};
#endif
}

/* The sum of a vector's lanes, in order. */
INLINE double total(lanes v) {
    double t = v[0];
    for (int j = 1; j < LANES; j++) t += v[j];
    return t;
}

/* The moments of n >= 1 values of each of w <= WIDE columns (column c at v + c * B): mean and
   M2 of each, its min and max joined into lo and hi. Value i goes to chain i % LANES, the
   last n % LANES values to the first chains. Unrolled where w is a constant. */
INLINE void columns_moments(
    const double *restrict v, int64_t B, int64_t n, int64_t w, double *restrict mean,
    double *restrict m2, double *restrict lo, double *restrict hi) {
    lanes s[WIDE], l[WIDE], h[WIDE], zero = {0.0};
    int64_t i, tail = n - n % LANES;
    for (int64_t c = 0; c < w; c++) {
        s[c] = zero;
        l[c] = zero + lo[c];
        h[c] = zero + hi[c];
    }
    for (i = 0; i < tail; i += LANES) {
        for (int64_t c = 0; c < w; c++) {
            lanes x = load(v + c * B + i);
            s[c] += x;
            l[c] = smaller(x, l[c]);
            h[c] = larger(x, h[c]);
        }
    }
    for (int64_t c = 0; c < w; c++) {
        for (int64_t j = 0; j < n - tail; j++) {
            double x = v[c * B + tail + j];
            s[c][j] += x;
            l[c][j] = x < l[c][j] ? x : l[c][j];
            h[c][j] = x > h[c][j] ? x : h[c][j];
        }
        double small = l[c][0], big = h[c][0];
        for (int j = 1; j < LANES; j++) {
            small = l[c][j] < small ? l[c][j] : small;
            big = h[c][j] > big ? h[c][j] : big;
        }
        mean[c] = total(s[c]) / (double)n;
        lo[c] = small;
        hi[c] = big;
        s[c] = zero;
        l[c] = zero + mean[c];  /* the mean in every lane */
    }
    for (i = 0; i < tail; i += LANES) {
        for (int64_t c = 0; c < w; c++) {
            lanes d = load(v + c * B + i) - l[c];
            s[c] += d * d;
        }
    }
    for (int64_t c = 0; c < w; c++) {
        for (int64_t j = 0; j < n - tail; j++) {
            double d = v[c * B + tail + j] - mean[c];
            s[c][j] += d * d;
        }
        m2[c] = total(s[c]);
    }
}

/* columns_moments over K columns, WIDE at a time. */
INLINE void run_moments(const double *v, int64_t B, int64_t n, int64_t K, double *mean,
                        double *m2, double *lo, double *hi) {
    for (int64_t c = 0; c < K; c += WIDE) {
        int64_t w = K - c < WIDE ? K - c : WIDE;
        if (w == WIDE)
            columns_moments(v + c * B, B, n, WIDE, mean + c, m2 + c, lo + c, hi + c);
        else if (w == 1)
            columns_moments(v + c * B, B, n, 1, mean + c, m2 + c, lo + c, hi + c);
        else
            columns_moments(v + c * B, B, n, w, mean + c, m2 + c, lo + c, hi + c);
    }
}

/* Rows x[0..rows) (T, k components) as columns of `columns` (stride B), row i at position
   filled[label[i]]++ (at i without labels), its norm (√Σ x², summed in the order of the
   components) as column k where `norm`. Without labels the norms are taken in passes of
   their own, whose roots run as vectors (4.4 -> 3.9 ns a row of 3 on one core); with labels
   the scattered stores bound the loop, and splitting it was slower (6.2 -> 6.7). */
#define PUT_ROWS(T)                                                                          \
    INLINE void put_rows_##T(const T *restrict x, int64_t rows, int64_t k, int norm,         \
                             const uint8_t *restrict label, int64_t *restrict filled,       \
                             double *restrict columns, int64_t B) {                          \
        if (label) {                                                                         \
            for (int64_t i = 0; i < rows; i++) {                                             \
                int64_t p = filled[label[i]]++;                                              \
                double s = 0.0;                                                              \
                for (int64_t c = 0; c < k; c++) {                                            \
                    double v = (double)x[i * k + c];                                         \
                    columns[c * B + p] = v;                                                  \
                    s += v * v;                                                              \
                }                                                                            \
                if (norm) columns[k * B + p] = sqrt(s);                                      \
            }                                                                                \
            return;                                                                          \
        }                                                                                    \
        double *norms = columns + k * B;                                                     \
        for (int64_t i = 0; i < rows && norm; i++) {                                         \
            double s = 0.0;                                                                  \
            for (int64_t c = 0; c < k; c++) {                                                \
                double v = (double)x[i * k + c];                                             \
                s += v * v;                                                                  \
            }                                                                                \
            norms[i] = s;                                                                    \
        }                                                                                    \
        for (int64_t i = 0; i < rows && norm; i++) norms[i] = sqrt(norms[i]);                \
        for (int64_t i = 0; i < rows; i++)                                                   \
            for (int64_t c = 0; c < k; c++) columns[c * B + i] = (double)x[i * k + c];       \
    }
PUT_ROWS(double)
PUT_ROWS(float)

/* put_rows_* for x's type (float32 where `single`), unrolled for 3-vectors and scalars. */
INLINE void put_rows(const void *x, int32_t single, int64_t rows, int64_t k, int norm,
                     const uint8_t *label, int64_t *filled, double *columns, int64_t B) {
    if (single && k == 3 && norm)
        put_rows_float(x, rows, 3, 1, label, filled, columns, B);
    else if (single)
        put_rows_float(x, rows, k, norm, label, filled, columns, B);
    else if (k == 3 && norm)
        put_rows_double(x, rows, 3, 1, label, filled, columns, B);
    else if (k == 1 && !norm)
        put_rows_double(x, rows, 1, 0, label, filled, columns, B);
    else
        put_rows_double(x, rows, k, norm, label, filled, columns, B);
}

/* A block's nb values of mean mb and M2 m2b merged into a group's count na, mean and M2 (one
   component). */
INLINE void merge(double na, double nb, double mb, double m2b, double *mean,
                         double *m2) {
    double n = na + nb, delta = mb - *mean;
    *mean += delta * (nb / n);
    *m2 += m2b + delta * delta * (na * nb / n);
}

/* Rows of a block of K components, at most `block` (>= 1). */
static int64_t block_rows(int64_t block, int64_t K) {
    int64_t rows = BLOCK_VALUES / K;
    return rows > block ? block : rows < 1 ? 1 : rows;
}

/* The distance between a block's columns: its rows and 64 bytes, so that the columns do not
   fall on the same cache sets (or alias the rows read) as they would 4 KiB apart. */
static int64_t column_stride(int64_t block, int64_t K) { return block_rows(block, K) + 8; }

/* Bytes of scratch that segcli_moments needs for blocks of `block` rows of K components in G
   groups (at most 256). */
int64_t segcli_moments_scratch(int64_t block, int64_t G, int64_t K) {
    return (int64_t)sizeof(double) * (2 * K + K * column_stride(block, K)) +
           (int64_t)sizeof(int64_t) * 2 * G + (block + 7) / 8 * 8;
}

/* Labels [first, first + rows) of `bytes` bytes each (unsigned: a negative integer's bits
   are a large one) as uint8 into `out`: -1, or the first row whose label is G or more. */
#define PUT_LABELS(T)                                                                        \
    INLINE int64_t put_labels_##T(const T *restrict labels, int64_t first, int64_t rows,      \
                                  int64_t G, uint8_t *restrict out) {                        \
        T worst = 0;                                                                         \
        for (int64_t i = 0; i < rows; i++) {                                                 \
            T label = labels[first + i];                                                     \
            worst = label > worst ? label : worst;                                           \
            out[i] = (uint8_t)label;                                                         \
        }                                                                                    \
        if ((uint64_t)worst < (uint64_t)G) return -1;                                        \
        for (int64_t i = 0; i < rows; i++)                                                   \
            if ((uint64_t)labels[first + i] >= (uint64_t)G) return first + i;                \
        return -1;                                                                           \
    }
PUT_LABELS(uint8_t)
PUT_LABELS(uint16_t)
PUT_LABELS(uint32_t)
PUT_LABELS(uint64_t)

INLINE int64_t put_labels(const void *labels, int32_t bytes, int64_t first, int64_t rows,
                          int64_t G, uint8_t *out) {
    switch (bytes) {
    case 1: return put_labels_uint8_t(labels, first, rows, G, out);
    case 2: return put_labels_uint16_t(labels, first, rows, G, out);
    case 4: return put_labels_uint32_t(labels, first, rows, G, out);
    default: return put_labels_uint64_t(labels, first, rows, G, out);
    }
}

/* The moments of rows x (n, k; float32 where `single`) in n_runs leaves of runs[] rows, in G
   groups of labels (n unsigned integers of `label_bytes` bytes; NULL: one group), with each
   row's norm as component k where `with_norm`, in blocks of `block` rows, added to count
   (L, G) and mean, m2, lo, hi (L, G, K), given as those of no rows (0, 0, +inf, -inf).
   Returns -1, or the first row whose label is G or more (the moments then left part-way). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(SEGCLI_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))  /* the same operations */
#else
#define CLONES
#endif
CLONES int64_t segcli_moments(const void *x, int32_t single, int64_t k, int32_t with_norm,
                              const int64_t *runs, int64_t n_runs, const void *labels,
                              int32_t label_bytes, int64_t G, int64_t block, int64_t *count,
                              double *mean, double *m2, double *lo, double *hi, void *scratch) {
    int64_t K = k + (with_norm != 0), B = block_rows(block, K), S = column_stride(block, K);
    int64_t row = 0;
    double *bmean = scratch, *bm2 = bmean + K, *columns = bm2 + K;
    int64_t *starts = (int64_t *)(columns + K * S), *filled = starts + G;
    uint8_t *block_labels = (uint8_t *)(filled + G);
    for (int64_t leaf = 0; leaf < n_runs; leaf++) {
        for (int64_t start = 0; start < runs[leaf]; start += B) {
            int64_t rows = runs[leaf] - start < B ? runs[leaf] - start : B;
            const uint8_t *label = NULL;
            if (labels) {
                int64_t bad = put_labels(labels, label_bytes, row, rows, G, block_labels);
                if (bad >= 0) return bad;
                label = block_labels;
            }
            memset(starts, 0, G * sizeof(int64_t));
            if (label) {
                for (int64_t i = 0; i < rows; i++) starts[label[i]]++;
            } else {
                starts[0] = rows;
            }
            for (int64_t g = 0, p = 0; g < G; g++) {
                int64_t n = starts[g];
                starts[g] = filled[g] = p;
                p += n;
            }
            put_rows((const char *)x + row * k * (single ? 4 : 8), single, rows, k, K > k,
                     label, filled, columns, S);
            if (!label) filled[0] = rows;
            for (int64_t g = 0; g < G; g++) {
                int64_t n = filled[g] - starts[g], o = (leaf * G + g) * K;
                if (!n) continue;
                double na = (double)count[leaf * G + g];
                run_moments(columns + starts[g], S, n, K, bmean, bm2, lo + o, hi + o);
                for (int64_t c = 0; c < K; c++)
                    merge(na, (double)n, bmean[c], bm2[c], mean + o + c, m2 + o + c);
                count[leaf * G + g] += n;
            }
            row += rows;
        }
    }
    return -1;
}
