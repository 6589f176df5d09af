    /* squares8.h: max_norm's plain search on CPUs over rows lo:hi (lo < hi) of group g, eight
       at a time in vector lanes (after lanes8.h and rows8.h; PLAIN_SQUARE, NEAR_RATIO and
       REAL_MAX the dtype's constants). Each lane keeps its largest square, the first row of
       it, and the largest before that row (take), so that no comparison waits on the one
       before and the segment is read once; `found` then gives the first row of the largest
       square if that square is plain and no row before it has a square a few units in the
       last place below it, -(row + 2) where one may, -1 where a square is NaN or the largest
       is not plain. Each square is the sum of the K products in order; rows of 3 features
       (G = 1) are loaded as 24 entries (`rows8`, never past x's end) and sorted into the lanes
       by shuffles (`squares8`), every product before any sum (no multiply-add can fuse them);
       a lane past hi holds 0. */
    const int k = x.shape[2];
    const int n = x.shape[0];
    const long long step = (long long)x.shape[1] * k;
    const real* rows = (const real*)x.data + (long long)g * k;
    lanes8 top = {-1, -1, -1, -1, -1, -1, -1, -1}, before = top;
    mask8 nan = {}, where = {};
    auto take = [&](int i, lanes8 square) {
        const mask8 taken = square > top;
        before = taken ? top : before;
        top = taken ? square : top;
        where = taken ? lane8 + i : where;
        nan |= square != square;
    };
    auto found = [&]() {
        const real best = __builtin_reduce_max(top);
        if (__builtin_reduce_or(nan) || !(best >= PLAIN_SQUARE && best <= REAL_MAX)) return -1;
        const int winner = __builtin_reduce_min(top == best ? where : hi);
        const real near = best * NEAR_RATIO;
        const mask8 close = (before >= near) | ((top >= near) & (where < winner));
        return __builtin_reduce_or(close) ? -(winner + 2) : winner;
    };
    auto squares8 = [&](int rows_left, lanes8 a, lanes8 b, lanes8 c) {
        a = a * a;
        b = b * b;
        c = c * c;
        const lanes8 ab0 = __builtin_shufflevector(a, b, 0, 3, 6, 9, 12, 15, 0, 0);
        const lanes8 ab1 = __builtin_shufflevector(a, b, 1, 4, 7, 10, 13, 0, 0, 0);
        const lanes8 ab2 = __builtin_shufflevector(a, b, 2, 5, 8, 11, 14, 0, 0, 0);
        lanes8 square = {};
        square = square + __builtin_shufflevector(ab0, c, 0, 1, 2, 3, 4, 5, 10, 13);
        square = square + __builtin_shufflevector(ab1, c, 0, 1, 2, 3, 4, 8, 11, 14);
        square = square + __builtin_shufflevector(ab2, c, 0, 1, 2, 3, 4, 9, 12, 15);
        return lane8 < rows_left ? square : 0;
    };
