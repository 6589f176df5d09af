    /* span_sum.cuh: Σ x[e] · f · y[e] over the entries e = lane, lane + lanes, ... of segment
       rows lo:hi and group g (of `groups`, `k` features each), in order; after lanes8.h
       (nothing on GPUs). Warp's float() and double() are macros, so no cast is spelled with
       them. */
    real acc = 0;
    const real* p = (const real*)x.data;
    const real* q = (const real*)y.data;
    if (groups == 1) {  /* entries lo·k .. hi·k (< 2³¹: Warp's shapes are int) */
#if defined(__CUDA_ARCH__)
        if (p == q && f == 1) {  /* Σ x²: each entry loaded once, the product by 1 left out
                                    (the same bits) */
            #pragma unroll 4
            for (int e = lo * k + lane; e < hi * k; e += lanes) {
                const real v = p[e];
                acc += v * v;
            }
        } else {
            #pragma unroll 4
            for (int e = lo * k + lane; e < hi * k; e += lanes) acc += p[e] * f * q[e];
        }
#else
        /* one thread: the sums of LANES = 8 lanes side by side (a CPU's vector lanes), the
           entries past hi masked, added as the GPU's butterfly adds them */
        auto load8 = [&](const real* data, int e) {  /* none past x's end */
            lanes8 v = {};
            if (e + 8 <= x.shape[0])
                __builtin_memcpy(&v, data + e, sizeof v);
            else
                __builtin_memcpy(&v, data + e, (x.shape[0] - e) * sizeof(real));
            return v;
        };
        lanes8 part = {};
        for (int e = lo * k; e < hi * k; e += 8) {
            const lanes8 u = load8(p, e), v = load8(q, e);
            part = lane8 < hi * k - e ? part + u * f * v : part;
        }
        acc = sum8(part);
#endif
    } else {
        for (int e = lane; e < (hi - lo) * k; e += lanes) {
            const int i = lo + e / k;
            const int at = (i * groups + g) * k + (e - (i - lo) * k);
            acc += p[at] * f * q[at];
        }
    }
    return acc;
