    /* lane_shift.cuh: log2 of `lanes`, a power of two. */
#if defined(__CUDA_ARCH__)
    return __ffs(lanes) - 1;
#else
    return __builtin_ctz((unsigned int)lanes);
#endif
