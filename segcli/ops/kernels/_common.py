"""What the kernel families share: a segment's rows, groups of lanes (a group of threads a
segment on GPUs, one thread on CPUs), and the factories of kernels over segments that several
families make theirs."""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c


@wp.func
def _segment_range(offsets: wp.array(dtype=wp.int32), s: int, n: int):
    lo = wp.clamp(offsets[s], 0, n)
    hi = wp.clamp(offsets[s + 1], lo, n)
    return lo, hi


# Segments reduced by a group of LANES consecutive threads on GPUs (one thread on CPUs).
# The entries of segment s and group g (its rows' features, in order) form a span; lane j
# of the group adds entries j, j + LANES, ... of it in order, by a loop in C, which the
# compiler unrolls (4 loads in flight per thread, where a loop in Warp's language keeps
# one), and a butterfly of shuffles then adds the lanes' sums, the same bits in every lane.
# With one group (G = 1) the span is contiguous, and a group's loads are of consecutive
# entries. On CPUs (which run threads one after another) lane 0 does its group's work
# alone, keeping the 8 lanes' sums side by side, which the compiler can put in vector
# registers. H200, N = 10⁷, (N, 3), given a Segments (benchmarks/RESULTS.md): dot in 86–89
# µs against 119–120 for a product a row and then a thread per segment, float32 (152
# against 188, float64); rms_norm float64 in 93–95 against 111–112 for a thread per segment
# and feature (float32 keeps that: 66 against 78). 4, 16 and 32 lanes, and a loop in Warp's
# language, ran slower.
LANES = 8


def lane_grid(groups, gpu, lanes=LANES):
    """(threads a group, launch dims) of a flat launch of `groups` groups of lanes: `lanes` on
    GPUs (1 on CPUs), halved while the launch would pass 2³¹ - 1 threads (Warp's thread index
    is an int)."""
    lanes = lanes if gpu else 1
    while lanes > 1 and groups * lanes >= 2**31:
        lanes //= 2
    return lanes, (groups * lanes,)


# A kernel of groups of lanes is launched flat, (groups · lanes,), and splits its thread's index
# itself: Warp's own (groups, lanes) launch unravels every index by a 64-bit division and
# modulo. ncu on an H100 (max_norm_lanes, float32, N = 10⁷): 55.6 → 44.4 M instructions, 92 →
# 78.5 µs (benchmarks/RESULTS.md).
@wp.func_native(_c.body("lane_shift.cuh"))
def _lane_shift(lanes: int) -> int:
    ...


@wp.func
def _lane_split(i: int, lanes: int):
    # (group, lane) of thread i of a flat launch of groups of `lanes` threads
    return i >> _lane_shift(lanes), i & (lanes - 1)


@wp.func_native(_c.body("lanes_here.cuh"))
def _lanes_here(lanes: int) -> int:
    ...


@wp.func_native(_c.body("lane_xor.cuh"))
def _lane_xor(v: wp.float32, offset: int, lanes: int) -> wp.float32:
    ...


@wp.func_native(_c.body("lane_xor.cuh"))
def _lane_xor(v: wp.float64, offset: int, lanes: int) -> wp.float64:
    ...


@wp.func_native(_c.body("sync_lanes.cuh"))
def _sync_lanes(lanes: int):
    ...


@wp.func_native(_c.body("lanes8.h", "span_sum.cuh", dtype="float32"))
def _span_sum(x: wp.array(dtype=wp.float32), y: wp.array(dtype=wp.float32), lo: int, hi: int,
              g: int, groups: int, k: int, lane: int, lanes: int, f: wp.float32) -> wp.float32:
    ...


@wp.func_native(_c.body("lanes8.h", "span_sum.cuh", dtype="float64"))
def _span_sum(x: wp.array(dtype=wp.float64), y: wp.array(dtype=wp.float64), lo: int, hi: int,
              g: int, groups: int, k: int, lane: int, lanes: int, f: wp.float64) -> wp.float64:
    ...


@wp.func
def _lanes_sum(v: Any, lanes: int):
    # Σ v over the lanes of the group, the same bits in each
    offset = lanes // 2
    while offset > 0:
        v = v + _lane_xor(v, offset, lanes)
        offset = offset // 2
    return v


@wp.func
def _lanes_max(v: Any, lanes: int):
    # the largest v over the lanes of the group (NaN passed over), the same in each
    offset = lanes // 2
    while offset > 0:
        v = wp.max(v, _lane_xor(v, offset, lanes))
        offset = offset // 2
    return v


@wp.func
def _group_of(offsets: wp.array(dtype=wp.int32), t: int, groups: int, n: int):
    # (s, g, lo, hi): the segment and group of lane group t (of M·G) and the segment's rows
    s = t // groups
    lo, hi = _segment_range(offsets, s, n)
    return s, t - s * groups, lo, hi


def _span_reduction(finish):
    """A kernel over x (N, G, K), a and b the same shape flat, w (M, G) or no rows, launched
    (M·G·lanes,): where the ids are ordered, group t of lanes writes out[s, g] =
    finish(x, lo, hi, g, Σ <a[i, g] · w[s, g], b[i, g]>) over the segment's rows lo:hi (w[s, g]
    = 1 where w has no rows); otherwise 0 (an atomic kernel then takes over)."""

    def kernel(
        x: wp.array3d(dtype=Any),
        a: wp.array(dtype=Any),
        b: wp.array(dtype=Any),
        w: wp.array2d(dtype=Any),
        offsets: wp.array(dtype=wp.int32),
        ordered: wp.array(dtype=wp.int32),
        lanes: int,
        out: wp.array2d(dtype=Any),
    ):
        t, lane = _lane_split(wp.tid(), lanes)
        lanes = _lanes_here(lanes)
        if lane >= lanes:
            return
        groups = out.shape[1]
        s = t // groups
        g = t - s * groups
        value = x.dtype(0.0)
        if ordered[0] != 0:
            lo, hi = _segment_range(offsets, s, x.shape[0])
            factor = x.dtype(1.0)
            if w.shape[0] > 0:
                factor = w[s, g]
            total = _lanes_sum(_span_sum(a, b, lo, hi, g, groups, x.shape[2], lane, lanes,
                                         factor), lanes)
            if lane == 0:
                value = finish(x, lo, hi, g, total)
        if lane == 0:
            out[s, g] = value

    return kernel


def _segment_reduction(term, rows=None, mean=False, ordered_path=True):
    """A kernel adding term(a, b, out, i, s, p) over the rows i of each segment s into
    out[s, p]; with `mean`, on the ordered path that sum divided by the segment's count
    (rounded once) where it is finite, else the sum of each term times 1/count (no partial sum
    of which overflows), and on the atomic path the plain sum, which the caller finishes.
    Without `ordered_path`, the kernel returns at once for ordered ids (another kernel
    reduces those).

    Launched over (max(M, stride), P) threads: with ordered ids, thread (s, p) adds its
    segment's rows in index order (bitwise repeatable), or with `rows` (a function of a, lo,
    hi and `mean`) takes that sum (or mean) of rows lo:hi from it; otherwise threads t < stride
    walk the rows t, t + stride, ... and add atomically into a zero-initialised `out`."""

    def kernel(
        a: wp.array2d(dtype=Any),
        b: wp.array2d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        offsets: wp.array(dtype=wp.int32),
        ordered: wp.array(dtype=wp.int32),
        stride: int,
        out: wp.array2d(dtype=Any),
    ):
        t, p = wp.tid()
        m = out.shape[0]
        if ordered[0] != 0:  # (the ids then unread, perhaps not passed: a's rows are N)
            if wp.static(ordered_path) and t < m:
                lo, hi = _segment_range(offsets, t, a.shape[0])
                acc = out.dtype(0)
                if wp.static(rows is not None):
                    acc = rows(a, lo, hi, wp.static(int(mean)))
                else:
                    for i in range(lo, hi):
                        acc += term(a, b, out, i, t, p)
                    if wp.static(mean):
                        acc = _mean_of_sum(a, out, lo, hi, p, acc)
                out[t, p] = acc
        elif t < stride:
            for i in range(t, idx.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < m:
                    wp.atomic_add(out, s, p, term(a, b, out, i, s, p))

    return kernel


@wp.func
def _mean_of_sum(a: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any), lo: int, hi: int, p: int,
                 total: Any):
    # the mean of a[lo:hi, p] from its plain sum `total`: total / count where finite, else
    # Σ a · (1/count), no partial sum of which overflows
    count = out.dtype(wp.max(hi - lo, 1))
    if wp.isfinite(total):
        return total / count
    w = out.dtype(1.0) / count
    scaled = out.dtype(0)
    for i in range(lo, hi):
        scaled += a[i, p] * w
    return scaled


@wp.func
def _atomic_above(best: wp.array2d(dtype=Any), s: int, g: int, key: Any):
    wp.atomic_max(best, s, g, key)


@wp.func
def _atomic_below(best: wp.array2d(dtype=Any), s: int, g: int, key: Any):
    wp.atomic_min(best, s, g, key)


@wp.func
def _atomic_sum(total: wp.array2d(dtype=Any), s: int, g: int, term: Any):
    wp.atomic_add(total, s, g, term)


@wp.func
def _no_rows3(x: wp.array2d(dtype=Any), lo: int, hi: int, s: int, p: int,
              out: wp.array3d(dtype=Any)):
    return 0


def _two_passes(segment, first_atomic, rows3=_no_rows3):
    """A kernel over x (N, K) into out (M, K, 2): where the ids are ordered, thread (s, p)
    writes out[s, p] = segment(x, lo, hi, p) of the rows lo:hi of segment s (both its passes
    over them, in index order), unless rows3(x, lo, hi, s, p, out) wrote all of out[s] (then
    1; a CPU's vector lanes over rows of 3); otherwise threads t < stride fold each row's
    x[i, p] into out[s, p] by first_atomic(out, s, p, x, i), and an `_atomic_pass` kernel
    takes over."""

    def kernel(x: wp.array2d(dtype=Any), idx: wp.array(dtype=wp.int32),
               offsets: wp.array(dtype=wp.int32), ordered: wp.array(dtype=wp.int32),
               stride: int, out: wp.array3d(dtype=Any)):
        t, p = wp.tid()
        m = out.shape[0]
        if ordered[0] != 0:
            if t < m:
                lo, hi = _segment_range(offsets, t, x.shape[0])
                if rows3(x, lo, hi, t, p, out) == 0:
                    first, second = segment(x, lo, hi, p)
                    out[t, p, 0] = first
                    out[t, p, 1] = second
        elif t < stride:
            for i in range(t, idx.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < m:
                    first_atomic(out, s, p, x, i)

    return kernel


def _atomic_pass(term):
    """A kernel adding term(x, i, p, firsts, s) over the rows i of each segment s atomically
    into a zero-initialised out[s, p], `firsts` (M, K, 2) being a `_two_passes` kernel's
    atomic first pass; nothing where the ids are ordered (that kernel did it all)."""

    def kernel(x: wp.array2d(dtype=Any), firsts: wp.array3d(dtype=Any),
               idx: wp.array(dtype=wp.int32), ordered: wp.array(dtype=wp.int32),
               stride: int, out: wp.array2d(dtype=Any)):
        t, p = wp.tid()
        m = out.shape[0]
        if ordered[0] == 0 and t < stride:
            for i in range(t, idx.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < m:
                    wp.atomic_add(out, s, p, term(x, i, p, firsts, s))

    return kernel


@wp.func
def _zero_rows_outside(offsets: wp.array(dtype=wp.int32), out: wp.array2d(dtype=Any)):
    # rows of out (N, K) before offsets[0] and from offsets[M] on (in no segment) set to 0
    n = out.shape[0]
    first = wp.clamp(offsets[0], 0, n)
    last = wp.clamp(offsets[offsets.shape[0] - 1], first, n)
    for i in range(first):
        for c in range(out.shape[1]):
            out[i, c] = out.dtype(0.0)
    for i in range(last, n):
        for c in range(out.shape[1]):
            out[i, c] = out.dtype(0.0)


# var's and softmax's derivatives where the ids are ordered (see _primitives.variance_tangent_p,
# softmax_tangent_p and softmax_curvature_p): a group of LANES threads per segment and
# feature, lane j taking rows lo + j, lo + j + LANES, ... of every pass over the segment, the
# group's sums and largest value by shuffles, the same in every lane. A thread per segment
# and feature walking its rows alone was latency-bound where segments are few (N = 10⁴–10⁵
# in float64; benchmarks/RESULTS.md).


def _segment_groups(body):
    """A kernel over x, a, b (N, K) into out, launched (M·K·lanes,), or ((M + 1)·K·lanes,)
    where out has x's rows, where the ids are ordered (else nothing written): the group (s < M,
    p) runs body(x, a, b, s, p, lo, hi, lane, lanes, out) over segment s's rows lo:hi; thread
    (M, 0, 0) zeroes the rows in no segment."""

    def kernel(x: wp.array2d(dtype=Any), a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any),
               offsets: wp.array(dtype=wp.int32), ordered: wp.array(dtype=wp.int32),
               lanes: int, out: wp.array2d(dtype=Any)):
        group, lane = _lane_split(wp.tid(), lanes)
        s = group // x.shape[1]
        p = group - s * x.shape[1]
        lanes = _lanes_here(lanes)
        if ordered[0] == 0 or lane >= lanes:
            return
        if s < offsets.shape[0] - 1:
            lo, hi = _segment_range(offsets, s, x.shape[0])
            body(x, a, b, s, p, lo, hi, lane, lanes, out)
        elif p == 0 and lane == 0:
            _zero_rows_outside(offsets, out)

    return kernel
