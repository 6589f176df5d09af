    /* rows8.h: rows8(rows, n, i, &a, &b, &c) loads rows i..i+7 of 3 entries of `rows` (n rows)
       as 24 entries in three vectors, never reading past row n (those past it 0); after
       lanes8.h. */
    auto rows8 = [](const real* rows, int n, int i, lanes8* a, lanes8* b, lanes8* c) {
        const real* p = rows + 3LL * i;
        real padded[24] = {};
        if (i + 8 > n) {
            __builtin_memcpy(padded, p, (n - i) * 3 * sizeof(real));
            p = padded;
        }
        __builtin_memcpy(a, p, sizeof *a);
        __builtin_memcpy(b, p + 8, sizeof *b);
        __builtin_memcpy(c, p + 16, sizeof *c);
    };
