    /* sum3_mean3.h: for rows lo:hi of 3 entries of `rows` (n rows), after lanes8.h and
       rows8.h: sum3(w), their Σ each times w, by one thread (CPUs): 8 rows (24 entries) at a
       time into three vectors of partial sums, the entries past hi masked (no scalar tail, no
       branch on the segment's length), added by sum24; mean3(total), their mean from their
       plain sum `total`: total / count, rounded once, in each entry where the sum is finite,
       else Σ v · (1/count), no partial sum of which overflows (summed again only where some
       entry needs it). */
    auto sum3 = [&](real w) {
        lanes8 sums[3] = {};
        for (int i = lo; i < hi; i += 8) {
            lanes8 v[3];
            rows8(rows, n, i, &v[0], &v[1], &v[2]);
            for (int k = 0; k < 3; k++)
                sums[k] = lane8 + 8 * k < 3 * (hi - i) ? sums[k] + v[k] * w : sums[k];
        }
        return wp::vec_t<3, real>(sum24(sums, 0), sum24(sums, 1), sum24(sums, 2));
    };
    auto mean3 = [&](wp::vec_t<3, real> total) {
        const real count = (real)(hi - lo > 1 ? hi - lo : 1);
        const bool finite = __builtin_isfinite(total[0]) && __builtin_isfinite(total[1]) &&
                            __builtin_isfinite(total[2]);
        const wp::vec_t<3, real> scaled = finite ? total : sum3((real)1 / count);
        wp::vec_t<3, real> out;
        for (int d = 0; d < 3; d++)
            out[d] = __builtin_isfinite(total[d]) ? total[d] / count : scaled[d];
        return out;
    };
