    /* rows3_sum.h: Σ of rows lo:hi of 3 entries of a, or with `mean` their mean (see
       sum3_mean3.h, after lanes8.h and rows8.h). */
    const real* rows = (const real*)a.data;
    const int n = a.shape[0];
