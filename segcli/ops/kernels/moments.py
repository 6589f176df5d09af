"""Moment kernels: each segment's mean and variance in two passes (var, std), and var's and
std's derivatives where the ids are ordered.

    moments     x (N, K)                     -> (M, K, 2)       (mean, Σ (x - mean)² / count):
                                                                both passes by a thread a
                                                                segment over ordered ids (on
                                                                CPUs rows of 3 in vector lanes,
                                                                moments_cpu), else sums and
                                                                counts by atomics, then
                                                                centered_squares
    variance_*, std_*  x, a, b (N, K)        -> (M, K) or       var's and std's tangents,
                                                (N, K)          cotangents and std's curvature
                                                                by a group of lanes a segment
                                                                and feature
"""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import (
    _atomic_pass,
    _lanes_sum,
    _segment_groups,
    _two_passes,
)
from segcli.ops.kernels._registry import ANY, kernel, variants


@wp.func
def _mean_of(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int):
    # Σ x[lo:hi, p] / count in index order, 0 if empty
    total = x.dtype(0.0)
    for i in range(lo, hi):
        total += x[i, p]
    return total / x.dtype(wp.max(hi - lo, 1))


@wp.func
def _lanes_mean(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int, lane: int, lanes: int):
    # _mean_of by a group of lanes, lane j adding rows lo + j, lo + j + lanes, ...: the same
    # mean in each lane. (_mean_of is not this with one lane: a loop whose step is a variable
    # made the moments and exp_sums kernels about 1.6 times as slow on an H100 at N = 10⁶.)
    total = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        total += x[i, p]
    return _lanes_sum(total, lanes) / x.dtype(wp.max(hi - lo, 1))


@wp.func
def _mean_and_variance(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int):
    # (mean, Σ (x - mean)² / count) of x[lo:hi, p], (0, 0) if empty: no cancellation
    count = x.dtype(wp.max(hi - lo, 1))
    mean = _mean_of(x, lo, hi, p)
    squares = x.dtype(0.0)
    for i in range(lo, hi):
        deviation = x[i, p] - mean
        squares += deviation * deviation
    return mean, squares / count


@wp.func
def _add_and_count(out: wp.array3d(dtype=Any), s: int, p: int, x: wp.array2d(dtype=Any),
                   i: int):
    wp.atomic_add(out, s, p, 0, x[i, p])
    wp.atomic_add(out, s, p, 1, x.dtype(1.0))


@wp.func
def _squared_deviation(x: wp.array2d(dtype=Any), i: int, p: int,
                       sums: wp.array3d(dtype=Any), s: int):
    # about the mean of the segment's (sum, count)
    deviation = x[i, p] - sums[s, p, 0] / wp.max(sums[s, p, 1], x.dtype(1.0))
    return deviation * deviation


@wp.func_native(_c.body("lanes8.h", "rows8.h", "moments3.h", "two_passes3.h", dtype="float32"))
def _moments3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int, s: int, p: int,
              out: wp.array3d(dtype=wp.float32)) -> int:
    """Both passes of the moments over rows lo:hi of x (N, 3) in vector lanes (CPUs; see
    two_passes3.h)."""
    ...


@wp.func_native(_c.body("lanes8.h", "rows8.h", "moments3.h", "two_passes3.h", dtype="float64"))
def _moments3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int, s: int, p: int,
              out: wp.array3d(dtype=wp.float64)) -> int:
    ...


@wp.func
def _variance_sum(x: wp.array2d(dtype=Any), y: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
                  s: int, p: int, lo: int, hi: int, lane: int, lanes: int,
                  out: wp.array2d(dtype=Any)):
    # out[s, p] = 2 Σ (x[i, p] - mean) y[i, p] / count (variance_tangent; b unused)
    mean = _lanes_mean(x, lo, hi, p, lane, lanes)
    total = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        total += (x[i, p] - mean) * y[i, p]
    total = _lanes_sum(total, lanes)
    if lane == 0:
        out[s, p] = x.dtype(2.0) * total / x.dtype(wp.max(hi - lo, 1))


@wp.func
def _variance_rows(x: wp.array2d(dtype=Any), c: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
                   s: int, p: int, lo: int, hi: int, lane: int, lanes: int,
                   out: wp.array2d(dtype=Any)):
    # out[i, p] = (x[i, p] - mean) · 2 c[s, p] / count (variance_cotangent; b unused)
    mean = _lanes_mean(x, lo, hi, p, lane, lanes)
    scale = x.dtype(2.0) * c[s, p] / x.dtype(wp.max(hi - lo, 1))
    for i in range(lo + lane, hi, lanes):
        out[i, p] = (x[i, p] - mean) * scale


@wp.func
def _lanes_std_scales(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int, lane: int,
                      lanes: int):
    # (mean, 1 / (count · std), 1 / var) of x[lo:hi, p] by the lanes; the two scales 0 where
    # var is 0
    mean = _lanes_mean(x, lo, hi, p, lane, lanes)
    squares = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        squares += (x[i, p] - mean) * (x[i, p] - mean)
    count = x.dtype(wp.max(hi - lo, 1))
    var = _lanes_sum(squares, lanes) / count
    scale = x.dtype(0.0)
    inverse_var = x.dtype(0.0)
    if var != x.dtype(0.0):
        scale = x.dtype(1.0) / (count * wp.sqrt(var))
        inverse_var = x.dtype(1.0) / var
    return mean, scale, inverse_var


@wp.func
def _std_sum(x: wp.array2d(dtype=Any), y: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
             s: int, p: int, lo: int, hi: int, lane: int, lanes: int,
             out: wp.array2d(dtype=Any)):
    # out[s, p] = Σ (x[i, p] - mean) y[i, p] / (count · std) (std_tangent; b unused)
    mean, scale, _inverse_var = _lanes_std_scales(x, lo, hi, p, lane, lanes)
    total = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        total += (x[i, p] - mean) * y[i, p]
    total = _lanes_sum(total, lanes)
    if lane == 0:
        out[s, p] = total * scale


@wp.func
def _std_rows(x: wp.array2d(dtype=Any), c: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
              s: int, p: int, lo: int, hi: int, lane: int, lanes: int,
              out: wp.array2d(dtype=Any)):
    # out[i, p] = (x[i, p] - mean) c[s, p] / (count · std) (std_cotangent; b unused)
    mean, scale, _inverse_var = _lanes_std_scales(x, lo, hi, p, lane, lanes)
    scale = scale * c[s, p]
    for i in range(lo + lane, hi, lanes):
        out[i, p] = (x[i, p] - mean) * scale


@wp.func
def _std_curvature(x: wp.array2d(dtype=Any), a: wp.array2d(dtype=Any),
                   c: wp.array2d(dtype=Any), s: int, p: int, lo: int, hi: int, lane: int,
                   lanes: int, out: wp.array2d(dtype=Any)):
    # out[i, p] = c[s, p] ((a[i] - mean a) - d[i] Σ d a / (count · var)) / (count · std),
    # d = x - mean (std_curvature)
    mean, scale, inverse_var = _lanes_std_scales(x, lo, hi, p, lane, lanes)
    mean_a = _lanes_mean(a, lo, hi, p, lane, lanes)
    products = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        products += (x[i, p] - mean) * a[i, p]
    ratio = _lanes_sum(products, lanes) * inverse_var / x.dtype(wp.max(hi - lo, 1))
    scale = scale * c[s, p]
    for i in range(lo + lane, hi, lanes):
        out[i, p] = ((a[i, p] - mean_a) - (x[i, p] - mean) * ratio) * scale


MOMENTS = variants(
    # op, step, device, ordering, size, kernel
    ("moments", "", "gpu", ANY, ANY,
     kernel("moments", _two_passes(_mean_and_variance, _add_and_count))),
    ("moments", "", "cpu", ANY, ANY,
     kernel("moments_cpu", _two_passes(_mean_and_variance, _add_and_count, _moments3))),
    ("moments", "atomic", ANY, ANY, ANY,
     kernel("centered_squares", _atomic_pass(_squared_deviation))),
    # var's and std's derivatives where the ids are ordered (see _primitives.variance_tangent_p
    # and std_tangent_p)
    ("var", "tangent", ANY, ANY, ANY, kernel("variance_tangent", _segment_groups(_variance_sum))),
    ("var", "cotangent", ANY, ANY, ANY,
     kernel("variance_cotangent", _segment_groups(_variance_rows))),
    ("std", "tangent", ANY, ANY, ANY, kernel("std_tangent", _segment_groups(_std_sum))),
    ("std", "cotangent", ANY, ANY, ANY, kernel("std_cotangent", _segment_groups(_std_rows))),
    ("std", "curvature", ANY, ANY, ANY,
     kernel("std_curvature", _segment_groups(_std_curvature))),
)
"""The moments (both passes where the ids are ordered, on CPUs rows of 3 in vector lanes;
else `atomic` sums, then squares about the means), and var's and std's derivatives."""
