    /* moments3.h: two_passes3.h's part for the moments: the mean (Σ x / count, as sum24 adds
       the lanes), then Σ (x - mean)² / count. */
    const real start = 0;
    auto fold = [](lanes8 lanes, lanes8 v) { return lanes + v; };
    auto firsts_done = [&](const lanes8* firsts, real count, real* first) {
        for (int c = 0; c < 3; c++) first[c] = sum24(firsts, c) / count;
    };
    auto second = [](lanes8 v, lanes8 centre, mask8 inside) {
        return (v - centre) * (v - centre);
    };
    auto redo = [](const real* rows, const real* first, lanes8* seconds) {};
    const bool divide = true;
