"""Norm kernels: the RMS norm of each segment's rows (rms_norm), its derivatives, and the
norms of rows that the searches and the several reductions share.

    rms_norm_span  x (N, G, K)               -> (M, G)          out[s,g] = sqrt(Σ_{idx[i]=s}
                                                                |x[i,g]|² / count) for ordered
                                                                ids (a group of LANES threads
                                                                per segment on GPUs), a segment
                                                                whose squares overflow or
                                                                underflow summed again scaled
                                                                by a power of two; otherwise
                                                                rms_norm_squares (Σ|x|² by
                                                                atomics), and rms_norm_top and
                                                                rms_norm_rescaled redo the
                                                                segments that over- or
                                                                underflowed
    sum_squares, rms_norm_of_squares            -> (M, G)       the same for float32 on GPUs,
                                                                ids known sorted: Σ x² per
                                                                feature, then the norms
    rms_norm_cotangent_span                  -> (N, G, K)       out[i,g] = x[i,g] · c[s,g] /
      x (N, G, K), c (M, G)                                     (count · norm[s,g]) for ids known
                                                                sorted: rms_norm's gradient, its
                                                                norms summed as rms_norm_span
                                                                sums them (a group of LANES
                                                                threads per segment on GPUs)
    rms_norm_curvature_span                  -> (N, G, K)       the JVP of that along rows (N, G,
      x, rows (N, G, K), dc, c (M, G)                           K) and dc (M, G), in one pass (see
                                                                the kernel)
    wide_squares  a (N, G·K) float32         -> (M, G·K, 2)     float64 Σ_{idx[i]=s} a[i,p]², as
                                                                uint32 pairs (GPUs, ids not
                                                                promised sorted; then
                                                                rms_norm_of_wide_squares, the
                                                                float32 RMS norms (M, G))
"""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import (
    _atomic_above,
    _atomic_sum,
    _group_of,
    _lane_split,
    _lanes_here,
    _lanes_sum,
    _segment_range,
    _segment_reduction,
    _span_reduction,
    _span_sum,
)
from segcli.ops.kernels._registry import ANY, kernel, variants


@wp.func
def _squared_entry(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any),
                   i: int, s: int, p: int):
    v = a[i, p]
    return v * v


@wp.func
def _group_square(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any),
                  i: int, s: int, p: int):
    # |x[i, p]|² of a = x (N, G·K) flat over its groups, out (M, G)
    k = a.shape[1] // out.shape[1]
    acc = a.dtype(0.0)
    for j in range(p * k, (p + 1) * k):
        acc += a[i, j] * a[i, j]
    return acc


def _over_features(step):
    """A @wp.func folding acc = step(acc, x[i, g, k], factor) over the features k of row (i, g)
    in order; unrolled for the usual 3 features (a loop bounded at run time is not, and
    costs a CPU more than the arithmetic)."""

    @wp.func
    def fold(x: wp.array3d(dtype=Any), i: int, g: int, acc: Any, factor: Any):
        if x.shape[2] == 3:
            for k in range(3):
                acc = step(acc, x[i, g, k], factor)
            return acc
        for k in range(x.shape[2]):
            acc = step(acc, x[i, g, k], factor)
        return acc

    return fold


@wp.func
def _add_square(acc: Any, v: Any, factor: Any):
    w = v * factor
    return acc + w * w


@wp.func
def _larger_magnitude(acc: Any, v: Any, factor: Any):
    return wp.max(acc, wp.abs(v))


_sum_of_squares = _over_features(_add_square)
_largest_magnitude = _over_features(_larger_magnitude)


@wp.func
def _squared_norm(x: wp.array3d(dtype=Any), i: int, g: int):
    return _sum_of_squares(x, i, g, x.dtype(0.0), x.dtype(1.0))


@wp.func
def _power_of_two(top: wp.float64):
    # (2^e, 2^-e) with 2^e <= top < 2^(e+1), e clamped to [-1022, 1021] so that both are
    # normal numbers (not flushed to zero): from the exponent bits of top >= 0
    e = wp.clamp((wp.cast(top, wp.int64) >> wp.int64(52)) & wp.int64(0x7FF), wp.int64(1),
                 wp.int64(2044))
    return (wp.cast(e << wp.int64(52), wp.float64),
            wp.cast((wp.int64(2046) - e) << wp.int64(52), wp.float64))


@wp.func
def _power_of_two(top: wp.float32):  # an overload per dtype: e clamped to [-126, 125]
    e = wp.clamp((wp.cast(top, wp.int32) >> 23) & 0xFF, 1, 252)
    return wp.cast(e << 23, wp.float32), wp.cast((254 - e) << 23, wp.float32)


@wp.func
def _largest_entry(x: wp.array3d(dtype=Any), i: int, g: int):
    return _largest_magnitude(x, i, g, x.dtype(0.0), x.dtype(0.0))


@wp.func
def _scaled_squared_norm(x: wp.array3d(dtype=Any), i: int, g: int, inverse: Any):
    return _sum_of_squares(x, i, g, x.dtype(0.0), inverse)


PLAIN_SQUARES = {"float32": 1e-20, "float64": 1e-280}
"""The smallest sum of squares taken as it is: at least 2^(mantissa + 32) times the smallest
normal number, so that squares lost to underflow (even 2^30 of them) change no bit of it."""
_PLAIN_FLOAT32 = PLAIN_SQUARES["float32"]
_PLAIN_FLOAT64 = PLAIN_SQUARES["float64"]


@wp.func
def _plain_square(square: wp.float64):
    # whether a sum of squares is finite and above _PLAIN_FLOAT64: then no square overflowed or
    # lost a bit to underflow, and it equals the sum of squares scaled by a power of two
    # (which changes no rounding) scaled back; False for NaN
    return square >= wp.float64(_PLAIN_FLOAT64) and not wp.isinf(square)


@wp.func
def _plain_square(square: wp.float32):  # an overload per dtype
    return square >= wp.float32(_PLAIN_FLOAT32) and not wp.isinf(square)


@wp.func
def _norm(x: wp.array3d(dtype=Any), i: int, g: int):
    # |x[i, g]|, its squares scaled by a power of two near the largest entry: no overflow or
    # underflow. Scaling by a power of two changes no rounding, so where the plain sum of
    # squares is safely inside the range it is taken as it is (the largest entry and the
    # scaled sum would cost twice the arithmetic of the sum alone).
    square = _squared_norm(x, i, g)
    if _plain_square(square):
        return wp.sqrt(square)
    scale, inverse = _power_of_two(_largest_entry(x, i, g))
    return scale * wp.sqrt(_scaled_squared_norm(x, i, g, inverse))


@wp.func
def _rms_of_squares(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, total: Any):
    # sqrt(total / n) for total = Σ |x[i, g]|² over rows lo:hi (n > 0); where that sum
    # overflowed or underflowed (or an entry is infinite), summed again with the rows scaled
    # by a power of two near the segment's largest entry
    count = x.dtype(hi - lo)
    if _plain_square(total):
        return wp.sqrt(total / count)
    top = x.dtype(0.0)
    for i in range(lo, hi):
        top = wp.max(top, _largest_entry(x, i, g))
    scale, inverse = _power_of_two(top)
    rescaled = x.dtype(0.0)
    for i in range(lo, hi):
        rescaled += _scaled_squared_norm(x, i, g, inverse)
    return scale * wp.sqrt(rescaled / count)


def _rms_norm_of_squares_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    squares: wp.array2d(dtype=Any),
    out: wp.array2d(dtype=Any),
):
    # Ordered ids: out[s, g], the segment's RMS norm (0 if empty) from squares[s, g·K + k], the
    # sums of x[i, g, k]² over its rows (sum_squares); 0 otherwise.
    s, g = wp.tid()
    out[s, g] = x.dtype(0.0)
    if ordered[0] != 0:
        lo, hi = _segment_range(offsets, s, x.shape[0])
        if lo < hi:
            k = x.shape[2]
            total = x.dtype(0.0)
            for j in range(k):
                total += squares[s, g * k + j]
            out[s, g] = _rms_of_squares(x, lo, hi, g, total)


def _wide_squares_kernel(
    a: wp.array2d(dtype=wp.float32),
    idx: wp.array(dtype=wp.int32),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    stride: int,
    counts: wp.array(dtype=wp.int32),
    out: wp.array3d(dtype=wp.uint32),
):
    # out (M, P, 2): the float64 Σ a[i, p]² of each segment (as uint32 pairs), where no
    # float32 square or sum overflows or underflows. Ordered ids: thread (s, p) adds its
    # segment's rows in order. Otherwise threads t < stride add atomically into zeros, and
    # count each segment's rows into `counts` (zeros).
    t, p = wp.tid()
    sums = wp.array(ptr=out.ptr, shape=(out.shape[0], out.shape[1]), dtype=wp.float64)
    n = a.shape[0]
    m = out.shape[0]
    if ordered[0] != 0:
        if t < m:
            lo, hi = _segment_range(offsets, t, n)
            acc = wp.float64(0.0)
            for i in range(lo, hi):
                v = wp.float64(a[i, p])
                acc += v * v
            sums[t, p] = acc
    elif t < stride:
        for i in range(t, n, stride):
            s = idx[i]
            if s >= 0 and s < m:
                v = wp.float64(a[i, p])
                wp.atomic_add(sums, s, p, v * v)
                if p == 0:
                    wp.atomic_add(counts, s, 1)


def _rms_norm_of_wide_squares_kernel(
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    rows: int,
    counts: wp.array(dtype=wp.int32),
    squares: wp.array3d(dtype=wp.uint32),
    out: wp.array2d(dtype=wp.float32),
):
    # out[s, g] = sqrt(Σ_k squares[s, g·K + k] / n) in float64 (wide_squares' sums, K =
    # squares.shape[1] / G), n the segment's rows (from the offsets if ordered, else
    # `counts`); 0 for an empty segment
    s, g = wp.tid()
    sums = wp.array(ptr=squares.ptr, shape=(squares.shape[0], squares.shape[1]),
                    dtype=wp.float64)
    k = squares.shape[1] // out.shape[1]
    lo, hi = _segment_range(offsets, s, rows)
    n = hi - lo
    if ordered[0] == 0:
        n = counts[s]
    out[s, g] = wp.float32(0.0)
    if n > 0:
        total = wp.float64(0.0)
        for j in range(g * k, (g + 1) * k):
            total += sums[s, j]
        out[s, g] = wp.float32(wp.sqrt(total / wp.float64(n)))


@wp.func
def _root_mean(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, total: Any):
    # the RMS norm of rows lo:hi from their Σ|x|² (0 if none; see _rms_of_squares)
    if lo < hi:
        return _rms_of_squares(x, lo, hi, g, total)
    return x.dtype(0.0)


# out[e] = (x[e] · a) · b, plus (y[e] · a) · c if `paired` (see span_scaled.cuh)
@wp.func_native(_c.body("span_scaled.cuh", dtype="float32"))
def _span_scaled(x: wp.array(dtype=wp.float32), y: wp.array(dtype=wp.float32),
                 out: wp.array(dtype=wp.float32), lo: int, hi: int, g: int, groups: int, k: int,
                 lane: int, lanes: int, a: wp.float32, b: wp.float32, c: wp.float32,
                 paired: int) -> int:
    ...


@wp.func_native(_c.body("span_scaled.cuh", dtype="float64"))
def _span_scaled(x: wp.array(dtype=wp.float64), y: wp.array(dtype=wp.float64),
                 out: wp.array(dtype=wp.float64), lo: int, hi: int, g: int, groups: int, k: int,
                 lane: int, lanes: int, a: wp.float64, b: wp.float64, c: wp.float64,
                 paired: int) -> int:
    ...


@wp.func
def _zero_rows(out: wp.array(dtype=Any), a: int, b: int, g: int, groups: int, k: int, lane: int,
               lanes: int):
    # rows a:b of group g of out (N·G·K entries, flat) set to 0 by the group's lanes
    for e in range(lane, (b - a) * k, lanes):
        i = a + e // k
        out[(i * groups + g) * k + e - (i - a) * k] = out.dtype(0.0)


@wp.func
def _zero_outside(out: wp.array(dtype=Any), offsets: wp.array(dtype=wp.int32), s: int, lo: int,
                  hi: int, g: int, groups: int, k: int, lane: int, lanes: int):
    # the first and last segments' lanes write 0 in the rows before and after every segment
    if s == 0:
        _zero_rows(out, 0, lo, g, groups, k, lane, lanes)
    if s == offsets.shape[0] - 2:
        _zero_rows(out, hi, out.shape[0] // (groups * k), g, groups, k, lane, lanes)


@wp.func
def _lanes_norm(x: wp.array3d(dtype=Any), entries: wp.array(dtype=Any), lo: int, hi: int, g: int,
                lane: int, lanes: int):
    # (the RMS norm of rows lo:hi of group g, ι a power of two near 1/norm), its squares summed
    # by the group's lanes as rms_norm_span sums them: the same bits, in each lane
    total = _lanes_sum(_span_sum(entries, entries, lo, hi, g, x.shape[1], x.shape[2], lane,
                                 lanes, x.dtype(1.0)), lanes)
    norm = _root_mean(x, lo, hi, g, total)
    _scale, inverse = _power_of_two(norm)
    return norm, inverse


def _rms_norm_rows(curvature):
    """rms_norm's cotangent of x (N, G, K) for a cotangent c (M, G) of its norms, or with
    `curvature` the JVP of that along rows (N, G, K) and dc (M, G), for ids whose offsets are
    known, launched (M·G·lanes,). Group t of lanes sums its segment's squares as rms_norm_span
    does (the same bits), takes ι, a power of two near 1/norm, and δ = count · norm · ι, and
    writes over the segment's rows (flat, as entries) out[i, g] = (x[i, g] · ι) · (c / δ), or
    (rows[i, g] · ι) · (c / δ) + (x[i, g] · ι) · ((dc - c · count · ι · S / δ²) / δ) with S =
    Σ <x[i, g] · ι, rows[i, g]> summed as dot_span sums it: the bits of rescale (rescale2 and
    scaled_dot) from the norms, 0 where the norm is 0. The first and last segments' groups
    also write 0 in the rows before and after every segment."""

    def kernel(
        x: wp.array3d(dtype=Any),
        entries: wp.array(dtype=Any),
        rows: wp.array(dtype=Any),
        dc: wp.array2d(dtype=Any),
        c: wp.array2d(dtype=Any),
        offsets: wp.array(dtype=wp.int32),
        lanes: int,
        out: wp.array(dtype=Any),
    ):
        t, lane = _lane_split(wp.tid(), lanes)
        lanes = _lanes_here(lanes)
        if lane >= lanes:
            return
        groups = x.shape[1]
        k = x.shape[2]
        s, g, lo, hi = _group_of(offsets, t, groups, x.shape[0])
        norm, inverse = _lanes_norm(x, entries, lo, hi, g, lane, lanes)
        dot = x.dtype(0.0)
        if wp.static(curvature):
            dot = _lanes_sum(_span_sum(entries, rows, lo, hi, g, groups, k, lane, lanes,
                                       inverse), lanes)
        first = x.dtype(0.0)
        along = x.dtype(0.0)
        if norm != x.dtype(0.0):
            count = x.dtype(hi - lo)
            divisor = count * (norm * inverse)
            first = c[s, g] / divisor
            if wp.static(curvature):
                along = (dc[s, g] - c[s, g] * count * inverse * dot / (divisor * divisor)) \
                    / divisor
        # (the cotangent's `rows` are x's own entries; the second array is read only paired)
        _span_scaled(rows, entries, out, lo, hi, g, groups, k, lane, lanes, inverse, first, along,
                     wp.static(1 if curvature else 0))
        _zero_outside(out, offsets, s, lo, hi, g, groups, k, lane, lanes)

    return kernel


@wp.func
def _largest_entry_of(x: wp.array3d(dtype=Any), i: int, g: int, factor: Any):
    return _largest_entry(x, i, g)


@wp.func
def _not_plain(squares: Any):
    return not _plain_square(squares)


def _overflow_rescue(term, accumulate, redo=_not_plain):
    """A kernel for unordered ids whose atomic sum (`sums`: by default Σ|x|²) went wrong
    somewhere (else it returns at once, its flag `overflowed` 0): accumulate(out, s, g, term(x,
    i, g, factors[s, g])) over the rows of each segment where redo(its sum) holds (by default:
    the squares are not plain, see _plain_square)."""

    def kernel(
        x: wp.array3d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        overflowed: wp.array(dtype=wp.int32),
        stride: int,
        sums: wp.array2d(dtype=Any),
        factors: wp.array2d(dtype=Any),
        out: wp.array2d(dtype=Any),
    ):
        t, g = wp.tid()
        if overflowed[0] != 0:
            for i in range(t, x.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < out.shape[0]:  # noqa: SIM102  (sums[s, g] only in range)
                    if redo(sums[s, g]):
                        accumulate(out, s, g, term(x, i, g, factors[s, g]))

    return kernel


# rms_norm of unordered ids that overflowed: the atomic max of each such segment's entries


NORMS = variants(
    # op, step, device, ordering, size, kernel
    ("rms_norm", "span", ANY, ANY, ANY,
     kernel("rms_norm_span", _span_reduction(_root_mean))),  # a = b = x
    ("rms_norm", "squares", ANY, ANY, ANY,
     kernel("rms_norm_squares", _segment_reduction(_group_square, ordered_path=False))),
    ("rms_norm", "top", ANY, ANY, ANY,
     kernel("rms_norm_top", _overflow_rescue(_largest_entry_of, _atomic_above))),
    ("rms_norm", "rescaled", ANY, ANY, ANY,
     kernel("rms_norm_rescaled", _overflow_rescue(_scaled_squared_norm, _atomic_sum))),
    ("rms_norm", "feature_squares", "gpu", ANY, ANY,
     kernel("sum_squares", _segment_reduction(_squared_entry))),
    ("rms_norm", "of_squares", "gpu", ANY, ANY,
     kernel("rms_norm_of_squares", _rms_norm_of_squares_kernel)),
    ("rms_norm", "wide_squares", "gpu", ANY, ANY,
     kernel("wide_squares", _wide_squares_kernel, dtypes=("float32",))),
    ("rms_norm", "of_wide_squares", "gpu", ANY, ANY,
     kernel("rms_norm_of_wide_squares", _rms_norm_of_wide_squares_kernel, dtypes=("float32",))),
    ("rms_norm", "cotangent", ANY, "offsets", ANY,
     kernel("rms_norm_cotangent_span", _rms_norm_rows(False))),
    ("rms_norm", "curvature", ANY, "offsets", ANY,
     kernel("rms_norm_curvature_span", _rms_norm_rows(True))),
)
"""rms_norm's kernels: on the ordered path one span reduction (`span`; on GPUs in float32, ids
known sorted and many rows, Σ x² per feature then the norms: `feature_squares`,
`of_squares`), else Σ|x|² by atomics (`squares`; in float32 on GPUs in float64: the
`wide_squares`) and the segments that over- or underflowed again (`top`, `rescaled`); its
cotangent and curvature for ids known sorted."""
