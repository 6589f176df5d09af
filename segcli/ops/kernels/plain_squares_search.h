    /* plain_squares_search.h: after squares8.h, the search itself (see there). */
    if (k == 3 && step == 3) {  /* whole blocks of 8 rows, then the last, masked */
        auto block = [&](int i, int rows_left) {
            lanes8 a, b, c;
            rows8(rows, n, i, &a, &b, &c);
            take(i, squares8(rows_left, a, b, c));
        };
        int i = lo;
        for (; i + 8 <= hi; i += 8) block(i, 8);
        if (i < hi) block(i, hi - i);
        return found();
    }
    for (int i = lo; i < hi; i += 8) {
        lanes8 square = {};
        for (int j = 0; j < 8 && i + j < hi; j++) {
            const real* row = rows + (i + j) * step;
            for (int f = 0; f < k; f++) {
                const real term = row[f] * row[f];
                square[j] = square[j] + term;
            }
        }
        take(i, square);
    }
    return found();
