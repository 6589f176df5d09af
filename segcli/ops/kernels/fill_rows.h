    /* fill_rows.h: the rows lo:hi of out, a (N,) vec3 array as 3N entries, set to (a, b, c)
       on CPUs, in a loop the compiler vectorises. */
    real* outs = (real*)out.data;
    for (long long i = 3LL * lo; i < 3LL * hi; i += 3) {
        outs[i] = a;
        outs[i + 1] = b;
        outs[i + 2] = c;
    }
