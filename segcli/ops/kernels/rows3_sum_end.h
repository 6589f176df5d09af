    /* rows3_sum_end.h: after sum3_mean3.h, rows3_sum's answer. */
    const wp::vec_t<3, real> total = sum3(1);
    return mean ? mean3(total) : total;
