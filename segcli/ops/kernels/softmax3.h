    /* softmax3.h: the softmax of rows lo:hi of 3 entries of x (N, 3) into the same rows of
       out, by one thread (CPUs), 8 rows at a time in vector lanes: each entry's shift (as
       exp_sums3.h finds it), its exponentials by exp8 written out and summed, then divided by
       their sum (0 where it is 0); wp::exp's exponentials where a difference is beyond exp8's
       range. After lanes8.h, rows8.h, exp8.h and shifts3.h. */
    auto put8 = [](real* dest, int i, int hi, const lanes8* v) {  /* rows i.. of the block */
        if (hi - i >= 8)
            __builtin_memcpy(dest + 3LL * i, v, 24 * sizeof(real));
        else
            __builtin_memcpy(dest + 3LL * i, v, 3 * (hi - i) * sizeof(real));
    };
    const real* rows = (const real*)x.data;
    real* dest = (real*)out.data;
    const int n = x.shape[0];
    lanes8 firsts[3], seconds[3] = {}, centre[3];
    for (int k = 0; k < 3; k++) firsts[k] = lanes8{} - (real)__builtin_inf();
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * (hi - i);
            firsts[k] = (inside & (v[k] > firsts[k])) ? v[k] : firsts[k];
        }
    }
    real first[3];
    shifts3(firsts, first);
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = first[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * (hi - i);
            v[k] = exp8(inside ? v[k] - centre[k] : 0);
            seconds[k] = inside ? seconds[k] + v[k] : seconds[k];
        }
        put8(dest, i, hi, v);
    }
    real totals[3];
    for (int c = 0; c < 3; c++) totals[c] = sum24(seconds, c);
    if (__builtin_reduce_or(unplain)) {  /* a difference beyond exp8's range: wp::exp's */
        for (int c = 0; c < 3; c++) totals[c] = 0;
        for (long long e = 3LL * lo; e < 3LL * hi; e++) {
            dest[e] = wp::exp(rows[e] - first[e % 3]);
            totals[e % 3] += dest[e];
        }
    }
    for (int k = 0; k < 3; k++)  /* 1 / Σ (0 where Σ is 0) */
        for (int l = 0; l < 8; l++)
            centre[k][l] = totals[(8 * k + l) % 3] != 0 ? 1 / totals[(8 * k + l) % 3] : 0;
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) v[k] = v[k] * centre[k];
        put8(dest, i, hi, v);
    }
