    /* softmax3_tangent.h: after softmax3.h, softmax's tangent along dx (N, 3) from the softmax
       s its rows hold: s (dx - Σ s dx), each entry's Σ over the segment (sum24 of the lanes). */
    const real* along = (const real*)dx.data;
    lanes8 dots[3] = {};
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3], d[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        rows8(along, n, i, &d[0], &d[1], &d[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane8 + 8 * k < 3 * (hi - i);
            dots[k] = inside ? dots[k] + v[k] * d[k] : dots[k];
        }
    }
    for (int c = 0; c < 3; c++) totals[c] = sum24(dots, c);
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = totals[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3], d[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        rows8(along, n, i, &d[0], &d[1], &d[2]);
        for (int k = 0; k < 3; k++) v[k] = v[k] * (d[k] - centre[k]);
        put8(dest, i, hi, v);
    }
