    /* lanes_squares_search.cuh: max_norm's ordered search on GPUs by a group of `lanes`
       threads a segment (PLAIN_SQUARE, NEAR_RATIO and REAL_MAX the dtype's constants): lane j
       takes rows lo + j, lo + j + lanes, ... of group g (rows of 3 alone, 16-byte aligned:
       the blocks j, j + lanes, ... of `per` rows, 48 bytes loaded as three 16-byte vectors;
       on an H100 float64's forward 149–158 → 110–114 µs at N = 10⁷, benchmarks/RESULTS.md),
       keeping its largest squared norm (`top`, at row `where`) and the largest of its other
       rows (`runner`), each row's square summed in the order of its entries; the lanes then
       join by butterflies. The answer is the first row of the largest square where that
       square is plain (PLAIN_SQUARE·4 to REAL_MAX/4) and no square is NaN or within
       NEAR_RATIO of it on another row (there norms may tie or, the squares summed by
       multiply-adds unlike the key's, change order); otherwise -1, for the one-thread search
       to decide. */
    const int k = x.shape[2];
    const long long step = (long long)x.shape[1] * k;
    const real* rows = (const real*)x.data + (long long)g * k;
    real top = -1, runner = -1;
    int where = hi, nan = 0;
    auto consider = [&](int i, real square) {
        nan |= square != square;
        if (square > top) {
            runner = top;
            top = square;
            where = i;
        } else if (square > runner) {
            runner = square;
        }
    };
#if defined(__CUDA_ARCH__)
    constexpr int per = 16 / sizeof(real);
    struct alignas(16) quad { real e[per]; };
    if (k == 3 && step == 3 && ((unsigned long long)x.data & 15) == 0) {
        const quad* blocks = (const quad*)x.data;
        const long long entries = 3LL * x.shape[0];
        for (int b = lo / per + lane; b * per < hi; b += lanes) {
            const long long first = 3LL * per * b;
            real v[3 * per];
            if (first + 3 * per <= entries) {
                for (int j = 0; j < 3; j++) {
                    const quad q = blocks[3LL * b + j];
                    for (int t = 0; t < per; t++) v[j * per + t] = q.e[t];
                }
            } else {  /* the array's last rows: nothing read past its end */
                for (int e = 0; e < 3 * per; e++) v[e] = first + e < entries ? rows[first + e] : 0;
            }
            for (int t = 0; t < per; t++) {
                const int i = b * per + t;
                const real* r = v + 3 * t;
                if (i >= lo && i < hi)
                    consider(i, fma(r[2], r[2], fma(r[1], r[1], fma(r[0], r[0], (real)0))));
            }
        }
    } else
#endif
    for (int i = lo + lane; i < hi; i += lanes) {
        const real* row = rows + i * step;
        real square = 0;
        for (int f = 0; f < k; f++) {
#if defined(__CUDA_ARCH__)
            square = fma(row[f], row[f], square);
#else
            square = square + row[f] * row[f];
#endif
        }
        consider(i, square);
    }
    real best = top;
#if defined(__CUDA_ARCH__)
    const unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    const unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    for (int o = lanes / 2; o > 0; o /= 2) {
        const real other = __shfl_xor_sync(mask, best, o, lanes);
        best = other > best ? other : best;
        nan |= __shfl_xor_sync(mask, nan, o, lanes);
    }
#endif
    int winner = top == best ? where : hi;
#if defined(__CUDA_ARCH__)
    for (int o = lanes / 2; o > 0; o /= 2) {
        const int other = __shfl_xor_sync(mask, winner, o, lanes);
        winner = other < winner ? other : winner;
    }
#endif
    const real near = best * NEAR_RATIO;
    int close = runner >= near || (top >= near && where != winner);
#if defined(__CUDA_ARCH__)
    for (int o = lanes / 2; o > 0; o /= 2) close |= __shfl_xor_sync(mask, close, o, lanes);
#endif
    const bool plain = best >= PLAIN_SQUARE * 4 && best <= REAL_MAX / 4;
    return nan || close || !plain ? -1 : winner;
