    /* reductions3.h: several reductions of the rows lo:hi of x (N, 1, 3) by one thread, each
       block of 8 rows (24 entries) read once for all those `want` asks (the bits WANT_SUM,
       WANT_MEAN, WANT_RMS, WANT_LARGEST): the sum and the mean into sums[s] and means[s] as
       rows3_sum gives them, Σ|x|² into rms[s] as span_sum adds it (one lane, factor 1),
       max_norm's search as plain_squares_search (its answer returned, else 0) and, where it
       found the row, that row's norm into largest[s]: every bit as those give it. CPUs only;
       after lanes8.h, rows8.h, squares8.h and sum3_mean3.h. */
    const bool sum = want & WANT_SUM, mean = want & WANT_MEAN, rms = want & WANT_RMS;
    const bool largest = want & WANT_LARGEST;
    const real f = 1;
    lanes8 plain[3] = {}, squares = {};
    auto block = [&](int i, int rows_left) {  /* whole blocks unmasked once inlined */
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * rows_left;
            if (sum || mean) plain[k] = inside ? plain[k] + v[k] * f : plain[k];
            if (rms) squares = inside ? squares + v[k] * f * v[k] : squares;
        }
        if (largest) take(i, squares8(rows_left, v[0], v[1], v[2]));
    };
    int i = lo;
    for (; i + 8 <= hi; i += 8) block(i, 8);
    if (i < hi) block(i, hi - i);
    const wp::vec_t<3, real> total(sum24(plain, 0), sum24(plain, 1), sum24(plain, 2));
    const wp::vec_t<3, real> average = mean ? mean3(total) : total;
    for (int d = 0; d < 3 && sum; d++) ((real*)sums.data)[3LL * s + d] = total[d];
    for (int d = 0; d < 3 && mean; d++) ((real*)means.data)[3LL * s + d] = average[d];
    if (rms) ((real*)rms_out.data)[s] = sum8(squares);
    if (!largest) return 0;
    const int winner = found();  /* its norm the root of its plain square, as _norm takes it */
    if (winner >= 0) ((real*)largest_out.data)[s] = wp::sqrt(__builtin_reduce_max(top));
    return winner;
