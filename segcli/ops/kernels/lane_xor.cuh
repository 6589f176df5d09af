    /* lane_xor.cuh: v of lane (this lane XOR offset) of the group (CPUs: one lane, v). */
#if defined(__CUDA_ARCH__)
    unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    return __shfl_xor_sync(mask, v, offset, lanes);
#else
    return v;
#endif
