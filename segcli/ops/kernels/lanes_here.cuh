    /* lanes_here.cuh: the lanes of a group where the kernel runs: `lanes` on GPUs, 1 on
       CPUs. */
#if defined(__CUDA_ARCH__)
    return lanes;
#else
    return 1;
#endif
