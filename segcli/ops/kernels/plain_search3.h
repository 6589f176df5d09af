    /* plain_search3.h: the first rows of rows lo:hi (lo < hi) of x (N, 3, 1) attaining each
       entry's largest value (`largest` 1, max) or smallest (0, min), 8 rows at a time in
       vector lanes: their 24 entries (`rows8`) sorted by shuffles into a vector per entry,
       each lane keeping its best value and the first row of it, starting from row lo's, so
       that no comparison waits on another; the lanes then give each entry's best value and
       its first row, or -1 where the entry has a NaN. After lanes8.h and rows8.h. */
    const real* rows = (const real*)x.data;
    lanes8 top[3];
    mask8 where[3], nan[3] = {};
    auto is_nan = [](auto u) { return u != u; };  /* generic: no warning for integers */
    for (int c = 0; c < 3; c++) {
        top[c] = lanes8{} + rows[3LL * lo + c];
        where[c] = mask8{} + lo;
    }
    for (int i = lo; i < hi; i += 8) {
        lanes8 a, b, c;
        rows8(rows, x.shape[0], i, &a, &b, &c);
        const lanes8 ab0 = __builtin_shufflevector(a, b, 0, 3, 6, 9, 12, 15, 0, 0);
        const lanes8 ab1 = __builtin_shufflevector(a, b, 1, 4, 7, 10, 13, 0, 0, 0);
        const lanes8 ab2 = __builtin_shufflevector(a, b, 2, 5, 8, 11, 14, 0, 0, 0);
        const lanes8 v[3] = {__builtin_shufflevector(ab0, c, 0, 1, 2, 3, 4, 5, 10, 13),
                             __builtin_shufflevector(ab1, c, 0, 1, 2, 3, 4, 8, 11, 14),
                             __builtin_shufflevector(ab2, c, 0, 1, 2, 3, 4, 9, 12, 15)};
        const mask8 inside = lane8 < hi - i;
        for (int e = 0; e < 3; e++) {
            const mask8 taken = inside & (largest ? v[e] > top[e] : v[e] < top[e]);
            top[e] = taken ? v[e] : top[e];
            where[e] = taken ? lane8 + i : where[e];
            nan[e] |= inside & is_nan(v[e]);
        }
    }
    int first[3];
    for (int e = 0; e < 3; e++) {
        const real best = largest ? __builtin_reduce_max(top[e]) : __builtin_reduce_min(top[e]);
        const int winner = __builtin_reduce_min(top[e] == best ? where[e] : hi);
        first[e] = __builtin_reduce_or(nan[e]) ? -1 : winner;
    }
    return wp::vec_t<3, wp::int32>(first[0], first[1], first[2]);
