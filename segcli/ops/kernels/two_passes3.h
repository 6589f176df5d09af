    /* two_passes3.h: both passes over rows lo:hi of 3 entries of x (N, 3) by one thread
       (CPUs), 8 rows (24 entries) at a time in vector lanes as rows3_sum takes them, into
       out[s] (M, 3, 2); only thread p = 0 of the segment works, and each returns 1 (0 where x
       is not (N, 3): nothing done). After lanes8.h, rows8.h and the kernel's own part
       (moments3.h, exp_sums3.h), which defines: `start`, the first pass's lanes at first;
       fold(lanes, v), the lanes after rows v; firsts_done(firsts, count, first), each entry's
       value first[c] from the first pass's lanes; second(v, centre, inside), each lane's term
       of the second pass (`centre` the lanes holding first[c] in the rows' layout);
       redo(rows, first, seconds), what redoes the second pass's sums where its lanes could
       not; `divide`, whether the second pass's sums are divided by the count. */
    if (x.shape[1] != 3) return 0;
    if (p != 0) return 1;
    const real* rows = (const real*)x.data;
    const int n = x.shape[0];
    const real count = (real)(hi - lo > 1 ? hi - lo : 1);
    lanes8 firsts[3], seconds[3] = {}, centre[3];
    for (int k = 0; k < 3; k++) firsts[k] = lanes8{} + start;
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * (hi - i);
            firsts[k] = inside ? fold(firsts[k], v[k]) : firsts[k];
        }
    }
    real first[3];
    firsts_done(firsts, count, first);
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = first[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * (hi - i);
            const lanes8 term = second(v[k], centre[k], inside);
            seconds[k] = inside ? seconds[k] + term : seconds[k];
        }
    }
    redo(rows, first, seconds);
    real* o = (real*)out.data + 6LL * s;
    for (int c = 0; c < 3; c++) {
        o[2 * c] = first[c];
        o[2 * c + 1] = divide ? sum24(seconds, c) / count : sum24(seconds, c);
    }
    return 1;
