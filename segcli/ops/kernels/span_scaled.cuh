    /* span_scaled.cuh: out[e] = (x[e] · a) · b, plus (y[e] · a) · c if `paired`, over the
       entries e = lane, lane + lanes, ... of segment rows lo:hi and group g (of `groups`, `k`
       features each), x, y and out flat: the bits of the scale kernels (each product a
       statement of its own, as Warp writes them); a plain loop over the span where G = 1,
       which a CPU's compiler vectorizes. */
    const real* p = (const real*)x.data;
    const real* q = (const real*)y.data;
    real* o = (real*)out.data;
    auto put = [&](int at) {
        real v = p[at] * a;
        v = v * b;
        if (paired) {
            real w = q[at] * a;
            w = w * c;
            v = v + w;
        }
        o[at] = v;
    };
    if (groups == 1) {
        for (int e = lo * k + lane; e < hi * k; e += lanes) put(e);
    } else {
        for (int e = lane; e < (hi - lo) * k; e += lanes) {
            const int i = lo + e / k;
            put((i * groups + g) * k + (e - (i - lo) * k));
        }
    }
    return 0;
