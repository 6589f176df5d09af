"""Reduction kernels: sums, means, counts, dots, outer products and label counts over each
segment's rows, and several reductions of rows of 3 in one pass (CPUs).

    count       idx as a (N, 1)              -> (M, 1)          out[s] = #{i : idx[i]=s}
    sum         x (N, K)                     -> (M, K)          out[s] = Σ_{idx[i]=s} x[i]
    mean        x (N, K)                     -> (M, K)          out[s] = Σ_{idx[i]=s} x[i] / count
                                                                for ordered ids (Σ x[i] · (1/count)
                                                                where Σ x[i] is not finite: no
                                                                partial sum overflows), else the
                                                                sum as `sum`; mean_rescued then
                                                                sums x[i] · w[s] (w = 1/count)
                                                                where that sum is not finite, and
                                                                mean_of_sums divides the others
    outer       a (N, G·K), b (N, G·L)       -> (M, G·K·L)      out[s,g] = Σ_{idx[i]=s} a[i,g] ⊗
                                                                b[i,g]
    sum3, mean3  rows of vec3 (N, 1)         -> (M, 1)          sum and mean for K = 3, on CPUs
                                                                (a GPU keeps more rows in flight
                                                                with a thread per feature, and
                                                                reads rows coalesced)
    reductions3  x (N, 1, 3)                 -> sums, means     sum3, mean3, rms_norm_span and
                                                (M, 1) vec3,    max_norm (its ordered search and
                                                rms, largest    the norm of the row found), those
                                                (M, 1)          a `want` mask asks, each block of
                                                                rows read once for all (CPUs,
                                                                ordered ids)
    dot_span    x, y (N·G·K,), w (M, G)      -> (M, G)          out[s,g] = Σ_{idx[i]=s} <x[i,g]
                                                                · w[s,g], y[i,g]> for ordered
                                                                ids (a group of LANES threads
                                                                per segment on GPUs); otherwise
                                                                dot_atomic
    bincount    labels (N,) int32|int64      -> (M, L) int32    out[s,c] = #{i : idx[i]=s,
                                                                labels[i]=c} over ordered ids
                                                                (GPUs: a warp a segment), else 0
                                                                (bincount_atomic then adds)

The reductions (count, sum, mean, outer, sum3, mean3, and the norms' sum_squares) come from one
factory (`_segment_reduction`) over the term each adds; sum is made for int32 and int64 as well
as the float types.
"""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import (
    _atomic_sum,
    _lane_split,
    _lanes_here,
    _segment_range,
    _segment_reduction,
    _span_reduction,
    _sync_lanes,
)
from segcli.ops.kernels._registry import ANY, FLOATS, INTEGERS, kernel, variants
from segcli.ops.kernels.norms import _norm, _overflow_rescue, _root_mean, _squared_norm
from segcli.ops.kernels.searches import (
    _above,
    _ordered_search,
    _squares_constants,
    _squares_resolved,
)


@wp.func
def _one(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any), i: int,
         s: int, p: int):
    return 1


@wp.func
def _entry(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any), i: int,
           s: int, p: int):
    return a[i, p]


@wp.func
def _outer_entry(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any),
                 i: int, s: int, p: int):
    # a (N, G·K) and b (N, G·L) into out (M, G·K·L), p = (g·K + k)·L + l
    k_count = out.shape[1] // b.shape[1]
    l_count = out.shape[1] // a.shape[1]
    g = p // (k_count * l_count)
    return a[i, g * k_count + (p // l_count) % k_count] * b[i, g * l_count + p % l_count]


_ROWS3_SUM = ("lanes8.h", "rows8.h", "rows3_sum.h", "sum3_mean3.h", "rows3_sum_end.h")
"""Σ of rows lo:hi of 3 entries of a, or with `mean` their mean (see sum3_mean3.h)."""


@wp.func_native(_c.body(*_ROWS3_SUM, dtype="float32"))
def _rows3_sum(a: wp.array2d(dtype=wp.vec3f), lo: int, hi: int, mean: int) -> wp.vec3f:
    ...


@wp.func_native(_c.body(*_ROWS3_SUM, dtype="float64"))
def _rows3_sum(a: wp.array2d(dtype=wp.vec3d), lo: int, hi: int, mean: int) -> wp.vec3d:
    ...


@wp.func
def _total(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, total: Any):
    return total


def _dot_atomic_kernel(
    x: wp.array3d(dtype=Any),
    y: wp.array3d(dtype=Any),
    w: wp.array2d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array2d(dtype=Any),
):
    # Ids not ordered (else it returns at once): threads t < stride add each row's dot (as
    # dot_span's, scaled by w) atomically into `out` (dot_span's zeros).
    t, g = wp.tid()
    if ordered[0] == 0:
        for i in range(t, x.shape[0], stride):
            s = idx[i]
            if s >= 0 and s < out.shape[0]:
                factor = x.dtype(1.0)
                if w.shape[0] > 0:
                    factor = w[s, g]
                acc = x.dtype(0.0)
                for k in range(x.shape[2]):
                    acc += x[i, g, k] * factor * y[i, g, k]
                wp.atomic_add(out, s, g, acc)


@wp.func
def _weighted_entry(x: wp.array3d(dtype=Any), i: int, g: int, factor: Any):
    return x[i, g, 0] * factor


@wp.func
def _not_finite(total: Any):
    return not wp.isfinite(total)


def _mean_of_sums_kernel(
    sums: wp.array2d(dtype=Any),
    counts: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    rescued: wp.array2d(dtype=Any),
    out: wp.array2d(dtype=Any),
):
    # the means of unordered ids from their atomic sums (M, K): each sum divided by its count,
    # rounded once (XLA would multiply by the reciprocal), or where the sum is not finite
    # mean_rescued's; the sums as they are where the ids were ordered (the mean kernel's means)
    s, p = wp.tid()
    total = sums[s, p]
    if ordered[0] == 0 and wp.isfinite(total):
        total = total / sums.dtype(wp.max(counts[s], 1))
    elif ordered[0] == 0:
        total = rescued[s, p]
    out[s, p] = total


REDUCE_BITS = {"sum": 1, "mean": 2, "rms_norm": 4, "max_norm": 8}
"""Each reduction's bit in reductions3's `want`."""
_WANT_RMS = wp.constant(REDUCE_BITS["rms_norm"])
_WANT_LARGEST = wp.constant(REDUCE_BITS["max_norm"])


_REDUCTIONS3 = ("lanes8.h", "rows8.h", "squares8.h", "sum3_mean3.h", "reductions3.h")
"""Several reductions of the rows lo:hi of x (N, 1, 3) by one thread (see reductions3.h)."""


def _reductions3_constants(dtype):
    bits = {f"WANT_{key}": REDUCE_BITS[name] for key, name in
            (("SUM", "sum"), ("MEAN", "mean"), ("RMS", "rms_norm"), ("LARGEST", "max_norm"))}
    return {**_squares_constants(dtype), **bits}


@wp.func_native(_c.body(*_REDUCTIONS3, dtype="float32",
                        constants=_reductions3_constants("float32")))
def _reductions3(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int, s: int, want: int,
                 sums: wp.array2d(dtype=wp.vec3f), means: wp.array2d(dtype=wp.vec3f),
                 rms_out: wp.array2d(dtype=wp.float32),
                 largest_out: wp.array2d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_c.body(*_REDUCTIONS3, dtype="float64",
                        constants=_reductions3_constants("float64")))
def _reductions3(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int, s: int, want: int,
                 sums: wp.array2d(dtype=wp.vec3d), means: wp.array2d(dtype=wp.vec3d),
                 rms_out: wp.array2d(dtype=wp.float64),
                 largest_out: wp.array2d(dtype=wp.float64)) -> int:
    ...


_first_of_largest_norm = _squares_resolved(_ordered_search(_norm, _above, _squared_norm), _norm)


def _reductions3_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    want: int,
    sums: wp.array2d(dtype=Any),
    means: wp.array2d(dtype=Any),
    rms: wp.array2d(dtype=Any),
    largest: wp.array2d(dtype=Any),
):
    # a thread per segment s: the reductions `want` asks of its rows (see reductions3.h), rms
    # then the RMS norm of its Σ|x|², and largest the norm of max_norm's row (left 0 where s
    # is empty), as _norm gives it (by the search where it found the row)
    s = wp.tid()
    lo, hi = _segment_range(offsets, s, x.shape[0])
    found = _reductions3(x, lo, hi, 0, s, want, sums, means, rms, largest)
    if (want & _WANT_RMS) != 0:
        rms[s, 0] = _root_mean(x, lo, hi, 0, rms[s, 0])
    if (want & _WANT_LARGEST) != 0 and lo < hi and found < 0:
        largest[s, 0] = _norm(x, _first_of_largest_norm(x, lo, hi, 0, found), 0)


BINCOUNT_LANES = 32
"""Lanes of a segment's group in bincount's kernel on GPUs: a warp, whose stores of a row of
zeros lie side by side and whose lanes then add a row each."""


@wp.func
def _label(labels: wp.array(dtype=Any), i: int, length: int):
    # labels[i] (int32 or int64) as an int where in [0, length), else -1
    c = labels[i]
    if c >= labels.dtype(0) and c < labels.dtype(length):
        return int(c)
    return -1


def _bincount_kernel(
    labels: wp.array(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    lanes: int,
    out: wp.array2d(dtype=wp.int32),
):
    # a group of lanes per segment s, launched (M·lanes,): where the ids are ordered, out[s, c]
    # = the rows of s with label c, else 0 (bincount_atomic then adds the rows); asked for
    # one lane (CPUs), `out` comes as zeros and each row adds 1
    s, lane = _lane_split(wp.tid(), lanes)
    asked = lanes
    lanes = _lanes_here(lanes)
    if lane >= lanes:
        return
    length = out.shape[1]
    lo, hi = _segment_range(offsets, s, labels.shape[0])
    if ordered[0] == 0:
        hi = lo
    if lanes == 1:
        if asked > 1:  # (the GPU's code paths on a CPU: `out` not zeros)
            for c in range(length):
                out[s, c] = 0
        for i in range(lo, hi):
            c = _label(labels, i, length)
            if c >= 0:
                out[s, c] = out[s, c] + 1
    else:  # the row zeroed by the lanes side by side, then each lane's rows added to it
        for c in range(lane, length, lanes):
            out[s, c] = 0
        _sync_lanes(lanes)
        for i in range(lo + lane, hi, lanes):
            c = _label(labels, i, length)
            if c >= 0:
                wp.atomic_add(out, s, c, 1)


def _bincount_atomic_kernel(
    labels: wp.array(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    out: wp.array2d(dtype=wp.int32),
):
    # Ids not ordered (else it returns at once): threads t < stride add each row i to
    # out[idx[i], labels[i]] (bincount's zeros) where both are in range.
    t = wp.tid()
    if ordered[0] == 0:
        for i in range(t, idx.shape[0], stride):
            s = idx[i]
            c = _label(labels, i, out.shape[1])
            if s >= 0 and s < out.shape[0] and c >= 0:
                wp.atomic_add(out, s, c, 1)


_VEC3 = {"a": "vec3", "b": "vec3", "out": "vec3"}

REDUCTIONS = variants(
    # op, step, device, ordering, size, kernel
    ("count", "", ANY, ANY, ANY,
     kernel("count", _segment_reduction(_one), dtypes=("int32",),
            elements={"a": "int32", "b": "int32", "out": "int32"})),
    # sum3 and mean3 (CPUs, rows of 3 floats) sum rows of vec3 by _rows3_sum. mean: on the
    # ordered path the sum / count where finite, else Σ a · (1/count) (no partial sum
    # overflows); on the atomic path the plain sum, which mean_of_sums finishes
    ("sum", "", "cpu", ANY, 3,
     kernel("sum3", _segment_reduction(_entry, rows=_rows3_sum), elements=_VEC3)),
    ("sum", "", ANY, ANY, ANY,
     kernel("sum", _segment_reduction(_entry), dtypes=FLOATS + INTEGERS)),
    ("mean", "", "cpu", ANY, 3,
     kernel("mean3", _segment_reduction(_entry, rows=_rows3_sum, mean=True), elements=_VEC3)),
    ("mean", "", ANY, ANY, ANY, kernel("mean", _segment_reduction(_entry, mean=True))),
    ("mean", "rescued", ANY, ANY, ANY,
     kernel("mean_rescued", _overflow_rescue(_weighted_entry, _atomic_sum, _not_finite))),
    ("mean", "of_sums", ANY, ANY, ANY, kernel("mean_of_sums", _mean_of_sums_kernel)),
    ("outer", "", ANY, ANY, ANY, kernel("outer", _segment_reduction(_outer_entry))),
    ("dot", "span", ANY, ANY, ANY, kernel("dot_span", _span_reduction(_total))),
    ("dot", "atomic", ANY, ANY, ANY, kernel("dot_atomic", _dot_atomic_kernel)),
    ("bincount", "", ANY, ANY, ANY, kernel("bincount", _bincount_kernel, dtypes=INTEGERS)),
    ("bincount", "atomic", ANY, ANY, ANY,
     kernel("bincount_atomic", _bincount_atomic_kernel, dtypes=INTEGERS)),
    ("reductions", "", "cpu", "offsets", 3,
     kernel("reductions3", _reductions3_kernel, elements={"sums": "vec3", "means": "vec3"})),
)
"""The reductions: a segment a thread over ordered ids, else atomics (in one kernel: the
`ordered` flag says which); mean's sums that are not finite summed again (`rescued`) and the
others divided (`of_sums`); dot and bincount by a group of lanes a segment, else `atomic`;
sum, mean, rms_norm and max_norm of rows of 3 in one pass (`reductions`, CPUs, ids known
sorted)."""
