    /* scale_rows.h: the ordered scale kernels' rows lo:hi of a segment on CPUs: out[i] = x[i]
       · factor · second, plus (b[i] · factor) · third where `paired`, over the 3 entries of
       each row, one operation a statement as the row-a-thread kernels compute them (so that
       no multiply-add fuses two and every bit is the same), in a loop the compiler
       vectorises. */
    const real* xs = (const real*)x.data;
    const real* bs = (const real*)b.data;
    real* outs = (real*)out.data;
    const long long first = 3LL * lo, last = 3LL * hi;
    if (paired) {
        for (long long i = first; i < last; i++) {
            const real scaled = xs[i] * factor;
            const real v = scaled * second;
            const real scaled_b = bs[i] * factor;
            const real u = scaled_b * third;
            outs[i] = v + u;
        }
    } else {
        for (long long i = first; i < last; i++) {
            const real scaled = xs[i] * factor;
            outs[i] = scaled * second;
        }
    }
