    /* lanes8.h: one CPU thread's vector lanes (`real` the dtype): lanes8, the masks of their
       comparisons (mask8), `lane8` (0..7), sum8 (the 8 lanes added as a GPU's butterfly adds
       them) and sum24 (the 24 lanes of three vectors added so, each feature's 8 apart); the
       compiler, left to itself, vectorizes such sums badly. Nothing on GPUs. */
#if !defined(__CUDA_ARCH__)
    typedef real lanes8 __attribute__((vector_size(8 * sizeof(real))));
    typedef decltype(lanes8{} != lanes8{}) mask8;
    const mask8 lane8 = {0, 1, 2, 3, 4, 5, 6, 7};
    auto sum8 = [](lanes8 v) {
        return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    };
    auto sum24 = [](const lanes8* v, int f) {
        real part[24];
        __builtin_memcpy(part, v, sizeof part);
        return ((part[f] + part[f + 12]) + (part[f + 6] + part[f + 18])) +
               ((part[f + 3] + part[f + 15]) + (part[f + 9] + part[f + 21]));
    };
#endif
