    /* plain_search.h: the first of rows lo:hi (lo < hi) of entry g (of `groups`) attaining
       the largest value (`largest` 1, max) or the smallest (0, min), by one pass of
       branch-free comparisons, or -1 where a value is NaN (integers never are). */
    const real* p = (const real*)x.data;
    real top = p[lo * groups + g];
    int winner = lo, nans = 0;
    auto is_nan = [](auto u) { return u != u; };  /* generic: no warning for integers */
    for (int i = lo; i < hi; i++) {
        const real v = p[i * groups + g];
        const bool taken = largest ? v > top : v < top;
        top = taken ? v : top;
        winner = taken ? i : winner;
        nans += is_nan(v);
    }
    return nans ? -1 : winner;
