    /* layout_run.h (CPUs): the offsets at the boundaries of a run of 4 ids. Thread t takes
       ids 4t..4t+3 and, for each i of them, writes out[s] = i for the s in (c(idx[i - 1]),
       c(idx[i])], c clamping to [-1, M] (c(idx[-1]) = -1); the thread holding the last id
       writes N from there to M. Meaningful for clamped ids non-decreasing, the only case that
       uses the offsets. (2 Mi ids on a 2-core VM: 2.9-3.0 ms, where one thread walking them
       took 4.5-4.6 and a binary search per segment 4.6-4.7; benchmarks/layout.py.) */
    const int* p = (const int*)idx.data;
    int* o = (int*)out.data;
    const int n = idx.shape[0], m = out.shape[0] - 1, i0 = 4 * t;
    if (i0 >= n) {  /* no ids: every offset 0 */
        for (int s = 0; t == 0 && s <= m; s++) o[s] = 0;
        return 0;
    }
    auto clamped = [m](int id) { return id < -1 ? -1 : id > m ? m : id; };
    int before = i0 == 0 ? -1 : clamped(p[i0 - 1]);
    for (int i = i0; i < i0 + 4 && i < n; i++) {
        const int c = clamped(p[i]);
        for (int s = before + 1; s <= c; s++) o[s] = i;
        before = c > before ? c : before;
    }
    if (i0 + 4 >= n)
        for (int s = before + 1; s <= m; s++) o[s] = n;
    return 0;
