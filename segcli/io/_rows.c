/* A selection's rows, for `segcli.io.core`: the rows of the structures a mask keeps, copied a
   run of kept structures at a time (`take`), and put back among the rows of every structure
   of their span, a fill row in those of the others (`spread`), at the speed of memcpy where
   NumPy's boolean and fancy indexing go an element at a time. Rows are `width` bytes;
   structure s has n_atoms[s] of them. */

#include <stdint.h>
#include <string.h>

/* Over the structures s < count, a run of kept ones (keep[s]) at a time: their rows copied
   from src to dst. For one not kept: without `fill` (take), its rows of src skipped; with it
   (spread), n_atoms[s] copies of the row `fill` written to dst. */
void segcli_runs(const char *src, int64_t width, const int64_t *n_atoms, const uint8_t *keep,
                 int64_t count, const char *fill, char *dst) {
    for (int64_t s = 0; s < count;) {
        int64_t rows = 0;
        for (; s < count && keep[s]; s++) rows += n_atoms[s];
        memcpy(dst, src, (size_t)(rows * width));
        src += rows * width;
        dst += rows * width;
        for (; s < count && !keep[s]; s++) {
            if (!fill) {
                src += n_atoms[s] * width;
                continue;
            }
            for (int64_t i = 0; i < n_atoms[s]; i++, dst += width) memcpy(dst, fill, (size_t)width);
        }
    }
}
