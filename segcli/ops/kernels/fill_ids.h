    /* fill_ids.h (CPUs): out[lo:hi] = id. */
    int* p = (int*)out.data;
    for (int i = lo; i < hi; i++) p[i] = id;
