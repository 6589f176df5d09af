    /* shifts3.h: shifts3(firsts, first) sets first[c], the shift of entry c, to the largest
       value of its lanes `firsts` (NaN passed over) where finite, else 0; after lanes8.h. */
    auto shifts3 = [](const lanes8* firsts, real* first) {
        real tops[24];
        __builtin_memcpy(tops, firsts, sizeof tops);
        for (int c = 0; c < 3; c++) {
            real top = tops[c];
            for (int e = c + 3; e < 24; e += 3) top = tops[e] > top ? tops[e] : top;
            first[c] = __builtin_isfinite(top) ? top : 0;
        }
    };
