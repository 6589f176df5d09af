"""Softmax kernels: each segment's largest value and Σ exp(x - shift) (logsumexp, softmax),
softmax itself on rows of 3 (CPUs), and its derivatives where the ids are ordered.

    exp_sums    x (N, K)                     -> (M, K, 2)       (shift, Σ exp(x - shift)), shift
                                                                the largest value where finite:
                                                                both passes by a thread a
                                                                segment over ordered ids (on
                                                                CPUs rows of 3 in vector lanes,
                                                                exp_sums_cpu), else the largest
                                                                values by atomics, then
                                                                shifted_exp_sums
    softmax3, softmax3_tangent  x, dx (N, 3) -> (N, 3)          softmax and its tangent, a
                                                                segment a thread in vector lanes
                                                                (CPUs, ordered ids)
    softmax_tangent, softmax_curvature       -> (N, K)          its tangent and second
      x, a, b (N, K)                                            derivative by a group of lanes a
                                                                segment and feature
"""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import (
    _atomic_pass,
    _lanes_max,
    _lanes_sum,
    _segment_groups,
    _segment_range,
    _two_passes,
    _zero_rows_outside,
)
from segcli.ops.kernels._registry import ANY, kernel, variants

_EXP_LANES = ("lanes8.h", "rows8.h", "exp8.h", "shifts3.h")
"""Vector lanes with exp8 and shifts3, as the CPU kernels over rows of 3 take them."""


@wp.func
def _shift_and_exp_sum(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int):
    # (shift, Σ exp(x - shift)) of x[lo:hi, p], shift its largest value where finite, else 0
    top = x.dtype(-wp.inf)
    for i in range(lo, hi):
        top = wp.max(top, x[i, p])
    shift = x.dtype(0.0)
    if wp.isfinite(top):
        shift = top
    total = x.dtype(0.0)
    for i in range(lo, hi):
        total += wp.exp(x[i, p] - shift)
    return shift, total


@wp.func
def _lanes_shift_and_exp_sum(x: wp.array2d(dtype=Any), lo: int, hi: int, p: int, lane: int,
                             lanes: int):
    # _shift_and_exp_sum by a group of lanes, lane j taking rows lo + j, lo + j + lanes, ...:
    # the same (shift, Σ) in each lane (see moments._lanes_mean for why two functions)
    top = x.dtype(-wp.inf)
    for i in range(lo + lane, hi, lanes):
        top = wp.max(top, x[i, p])
    top = _lanes_max(top, lanes)
    shift = x.dtype(0.0)
    if wp.isfinite(top):
        shift = top
    total = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        total += wp.exp(x[i, p] - shift)
    return shift, _lanes_sum(total, lanes)


@wp.func
def _raise_top(out: wp.array3d(dtype=Any), s: int, p: int, x: wp.array2d(dtype=Any), i: int):
    wp.atomic_max(out, s, p, 0, x[i, p])


@wp.func
def _shifted_exp(x: wp.array2d(dtype=Any), i: int, p: int, tops: wp.array3d(dtype=Any), s: int):
    shift = x.dtype(0.0)
    if wp.isfinite(tops[s, p, 0]):
        shift = tops[s, p, 0]
    return wp.exp(x[i, p] - shift)


@wp.func_native(_c.body(*_EXP_LANES, "exp_sums3.h", "two_passes3.h", dtype="float32"))
def _exp_sums3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int, s: int, p: int,
               out: wp.array3d(dtype=wp.float32)) -> int:
    """Both passes of exp_sums over rows lo:hi of x (N, 3) in vector lanes (CPUs; see
    two_passes3.h)."""
    ...


@wp.func_native(_c.body(*_EXP_LANES, "exp_sums3.h", "two_passes3.h", dtype="float64"))
def _exp_sums3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int, s: int, p: int,
               out: wp.array3d(dtype=wp.float64)) -> int:
    ...


_RETURN = "    return 0;\n"


@wp.func_native(_c.body(*_EXP_LANES, "softmax3.h", dtype="float32", end=_RETURN))
def _softmax3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int,
              out: wp.array2d(dtype=wp.float32)) -> int:
    """The softmax of rows lo:hi of x (N, 3) into out (CPUs; see softmax3.h)."""
    ...


@wp.func_native(_c.body(*_EXP_LANES, "softmax3.h", dtype="float64", end=_RETURN))
def _softmax3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int,
              out: wp.array2d(dtype=wp.float64)) -> int:
    ...


@wp.func_native(_c.body(*_EXP_LANES, "softmax3.h", "softmax3_tangent.h", dtype="float32",
                        end=_RETURN))
def _softmax3_tangent(x: wp.array2d(dtype=wp.float32), dx: wp.array2d(dtype=wp.float32), lo: int,
                      hi: int, out: wp.array2d(dtype=wp.float32)) -> int:
    """softmax's tangent along dx over rows lo:hi (CPUs; see softmax3_tangent.h)."""
    ...


@wp.func_native(_c.body(*_EXP_LANES, "softmax3.h", "softmax3_tangent.h", dtype="float64",
                        end=_RETURN))
def _softmax3_tangent(x: wp.array2d(dtype=wp.float64), dx: wp.array2d(dtype=wp.float64), lo: int,
                      hi: int, out: wp.array2d(dtype=wp.float64)) -> int:
    ...


def _rows3_or_zeros(rows3):
    """A kernel over x and dx (N, 3) into out, launched M + 1 threads, where the ids are ordered
    (else nothing written): segment s < M's rows by rows3(x, dx, lo, hi, out), thread M the
    rows in no segment (_zero_rows_outside)."""

    def kernel(x: wp.array2d(dtype=Any), dx: wp.array2d(dtype=Any),
               offsets: wp.array(dtype=wp.int32), ordered: wp.array(dtype=wp.int32),
               out: wp.array2d(dtype=Any)):
        s = wp.tid()
        if ordered[0] == 0:
            return
        if s < offsets.shape[0] - 1:
            lo, hi = _segment_range(offsets, s, x.shape[0])
            rows3(x, dx, lo, hi, out)
        else:
            _zero_rows_outside(offsets, out)

    return kernel


@wp.func
def _softmax_rows3(x: wp.array2d(dtype=Any), dx: wp.array2d(dtype=Any), lo: int, hi: int,
                   out: wp.array2d(dtype=Any)):
    return _softmax3(x, lo, hi, out)  # (dx unused)


@wp.func
def _softmax_tangent_rows3(x: wp.array2d(dtype=Any), dx: wp.array2d(dtype=Any), lo: int,
                           hi: int, out: wp.array2d(dtype=Any)):
    return _softmax3_tangent(x, dx, lo, hi, out)


@wp.func
def _no_means(x: wp.array2d(dtype=Any), a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
              lo: int, hi: int, p: int, shift: Any, total: Any, lane: int, lanes: int):
    return x.dtype(0.0), x.dtype(0.0)


@wp.func
def _softmax_means(x: wp.array2d(dtype=Any), a: wp.array2d(dtype=Any),
                   b: wp.array2d(dtype=Any), lo: int, hi: int, p: int, shift: Any, total: Any,
                   lane: int, lanes: int):
    # (Σ e a, Σ e b) over rows lo:hi of column p, e = exp(x - shift) / total, by the lanes
    alpha = x.dtype(0.0)
    beta = x.dtype(0.0)
    for i in range(lo + lane, hi, lanes):
        e = wp.exp(x[i, p] - shift) / total
        alpha += e * a[i, p]
        beta += e * b[i, p]
    return _lanes_sum(alpha, lanes), _lanes_sum(beta, lanes)


@wp.func
def _row_of_a(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), i: int, p: int,
              alpha: Any, beta: Any):
    return a[i, p]


@wp.func
def _centred_product(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), i: int, p: int,
                     alpha: Any, beta: Any):
    return (a[i, p] - alpha) * (b[i, p] - beta)


def _softmax_rows(means, term):
    """The body (see _segment_groups) writing out[i, p] = e[i] (q[i] - Σ e q) over a segment's
    rows, e = exp(x - shift) / Σ exp(x - shift) (e = 0 where Σ is 0), q[i] = term(a, b, i, p,
    means(...))."""

    def body(x: wp.array2d(dtype=Any), a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
             s: int, p: int, lo: int, hi: int, lane: int, lanes: int,
             out: wp.array2d(dtype=Any)):
        shift, total = _lanes_shift_and_exp_sum(x, lo, hi, p, lane, lanes)
        if total == x.dtype(0.0):
            total = x.dtype(1.0)  # every exp is 0 (a segment of -inf): e = 0, not 0 / 0
        alpha, beta = means(x, a, b, lo, hi, p, shift, total, lane, lanes)
        dot = x.dtype(0.0)
        for i in range(lo + lane, hi, lanes):
            dot += wp.exp(x[i, p] - shift) / total * term(a, b, i, p, alpha, beta)
        dot = _lanes_sum(dot, lanes)
        for i in range(lo + lane, hi, lanes):
            out[i, p] = wp.exp(x[i, p] - shift) / total * (term(a, b, i, p, alpha, beta) - dot)

    body.__name__ = body.__qualname__ = f"_softmax_rows_{term.key}"
    return wp.func(body)


SOFTMAX = variants(
    # op, step, device, ordering, size, kernel
    ("exp_sums", "", "gpu", ANY, ANY,
     kernel("exp_sums", _two_passes(_shift_and_exp_sum, _raise_top))),
    ("exp_sums", "", "cpu", ANY, ANY,
     kernel("exp_sums_cpu", _two_passes(_shift_and_exp_sum, _raise_top, _exp_sums3))),
    ("exp_sums", "atomic", ANY, ANY, ANY, kernel("shifted_exp_sums", _atomic_pass(_shifted_exp))),
    ("softmax", "", "cpu", ANY, 3, kernel("softmax3", _rows3_or_zeros(_softmax_rows3))),
    ("softmax", "tangent", "cpu", ANY, 3,
     kernel("softmax3_tangent", _rows3_or_zeros(_softmax_tangent_rows3))),
    # softmax's tangent along a: q = a; its curvature along a and b (the second derivative, a
    # symmetric bilinear map): q = (a - Σ e a)(b - Σ e b)
    ("softmax", "tangent", ANY, ANY, ANY,
     kernel("softmax_tangent", _segment_groups(_softmax_rows(_no_means, _row_of_a)))),
    ("softmax", "curvature", ANY, ANY, ANY,
     kernel("softmax_curvature",
            _segment_groups(_softmax_rows(_softmax_means, _centred_product)))),
)
"""exp_sums (both passes where the ids are ordered, on CPUs rows of 3 in vector lanes; else the
largest values by atomics, then the `atomic` sums), softmax and its tangent on rows of 3
(CPUs), and its tangent and curvature by groups of lanes."""
