    /* sync_lanes.cuh: waits for every lane of the group, whose memory writes before are then
       seen by all (CPUs: one lane, nothing to wait for). */
#if defined(__CUDA_ARCH__)
    unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    __syncwarp(mask);
#endif
