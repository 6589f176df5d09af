    /* exp_sums3.h: two_passes3.h's part for the exponentials' sums, after exp8.h and
       shifts3.h: the largest value of each entry (NaN passed over), then Σ exp(x - shift),
       shifted by it where finite. */
    const real start = -(real)__builtin_inf();
    auto fold = [](lanes8 lanes, lanes8 v) { return v > lanes ? v : lanes; };
    auto firsts_done = [&](const lanes8* firsts, real count, real* first) {
        shifts3(firsts, first);
    };
    auto second = [&](lanes8 v, lanes8 centre, mask8 inside) {
        return exp8(inside ? v - centre : 0);
    };
    auto redo = [&](const real* rows, const real* first, lanes8* seconds) {
        if (__builtin_reduce_or(unplain)) {  /* a difference beyond exp8's range: wp::exp's */
            real sums[3] = {};
            for (int i = lo; i < hi; i++)
                for (int c = 0; c < 3; c++) sums[c] += wp::exp(rows[3LL * i + c] - first[c]);
            for (int k = 0; k < 3; k++) seconds[k] = lanes8{};
            for (int c = 0; c < 3; c++) seconds[0][c] = sums[c];  /* entry c's lane */
        }
    };
    const bool divide = false;
