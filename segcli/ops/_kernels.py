"""Warp kernels for the segment primitives, and their JAX bindings.

Shapes (rows first, then a group axis G that vmap folds into, then features):

    layout      idx (N,)                     -> offsets (M+1,)  offsets[s] = first i with
                                                                idx[i] >= s (a binary search per
                                                                segment on GPUs; layout_runs, a
                                                                thread per 4 ids, on CPUs)
    segment_ids  offsets (M+1,)              -> ids (N,)        ids[i] = s for offsets[s] <= i <
                                                                offsets[s+1], -1 ahead of
                                                                offsets[0], M from offsets[M]
                                                                (a thread per run of one id)
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
    max_*, min_*, max_norm_*  x (N, G, K)    -> first (M, G)    the first row i attaining the
                                                                largest x[i,g,0] (max), smallest
                                                                (min), largest |x[i,g]|
                                                                (max_norm, each norm scaled by a
                                                                power of two: no overflow); N if
                                                                none (max_norm_lanes: its ordered
                                                                search on GPUs, a group of
                                                                MAX_NORM_LANES threads per
                                                                segment)
    max_norm_packed  x (N, G, K) float32     -> keys (M, G, 2)  the uint64 atomic max of (bits of
                                                                |x[i,g]|) << 32 | (2³² - 1 - i),
                                                                as uint32 pairs (GPUs, ids not
                                                                known sorted, in any order; no
                                                                layout)
    bincount    labels (N,) int32|int64      -> (M, L) int32    out[s,c] = #{i : idx[i]=s,
                                                                labels[i]=c} over ordered ids
                                                                (GPUs: a warp a segment), else 0
                                                                (bincount_atomic then adds)
    gather      y (R, K), idx (L,)           -> (L, K)          out[i] = y[idx[i]]
    scale       x (N, G, K), y, z (M, G)     -> (N, G, K)       out[i,g] = x[i,g] * y[idx[i],g]
                                                                (then * z[idx[i],g] if z has
                                                                rows)
    scale_pair  x, b (N, G, K), y, z, w      -> (N, G, K)       the same + b[i,g] * y[idx[i],g]
                                                                * w[idx[i],g]
    matvec      v (N, G, K), m (M, G, K, K)  -> (N, G, K)       out[i,g] = v[i,g] @ m[idx[i],g]
                                                                (@ m[idx[i],g]ᵀ with `transpose`)
    put         ct (M, G, K), first (M, G)   -> (N, G, K)       out[i,g] = ct[idx[i],g] if
                                                                first[idx[i],g] = i, else 0
    gather3, scale3, scale_pair3, matvec3                       the same for G = 1, K = 3
    put3                                                        put for G·K = 3
    gather3_ordered, scale3_ordered,                            the same, a segment a thread
      scale_pair3_ordered, matvec3_ordered                      over its CSR range (CPUs, the
                                                                offsets given)

The reductions (count, sum, mean, outer, sum3, mean3, sum_squares) come from one factory
(`_segment_reduction`) over the term each adds, and the searches for extremes from another
(`_extreme`) over the key they compare. sum, max and min are made for int32 and int64 as
well as the float types.

Ids outside [0, M) are skipped by reductions and give 0 in gathers; no id reads or writes
outside an array. Reductions take `ordered`, a one-element flag computed from the ids: when it
is 1 (ids non-decreasing) each segment is reduced by one thread over its own CSR range in
index order, so results are bitwise repeatable; when it is 0 the kernel falls back to
float atomics over a grid-stride loop into a zero-initialised output.
"""

import functools
import math
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from segcli.ops import _native

wp.config.log_level = wp.LOG_ERROR


def _init_warp():
    """Initialise Warp; where JAX runs on the CPU, without the native warning that no CUDA
    driver was found (irrelevant there, and noise on every command's stderr). An OSError
    names the kernel cache Warp could not make."""
    try:
        _start_warp()
    except OSError as err:
        raise OSError(err.errno, f"cannot hold Warp's kernel cache ({err.strerror}); set "
                                 "WARP_CACHE_PATH or XDG_CACHE_HOME to a writable directory",
                      err.filename) from err


def _start_warp():
    if jax.default_backend() != "cpu":
        wp.init()
        return
    if sys.stderr is not None:
        sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            wp.init()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_init_warp()


def pinned_bytes(size):
    """A NumPy uint8 array of `size` bytes, in page-locked host memory (which GPUs copy from
    at full speed, held as long as the array is) where Warp sees a CUDA device."""
    if not wp.is_cuda_available():
        return np.empty(size, np.uint8)
    return wp.empty(size, dtype=wp.uint8, device="cpu", pinned=True).numpy()


def cpu_available():
    """Whether this Warp build can run kernels on the CPU (it needs Warp's LLVM backend)."""
    return wp.is_cpu_available()

# Threads per block on a GPU: 128 runs the gathers up to 16 % faster than 256 on an H200 and
# the other kernels as fast (benchmarks/RESULTS.md).
_BLOCK_DIM = 128

# Rows whose keys the ordered search for an extreme computes together, ahead of comparing
# them in order, so that a thread walking its segment keeps several rows in flight (max_norm's
# one-thread search on an H200, before max_norm_lanes: 215 → 167 µs at N = 10⁷; the same for
# sum and rms_norm bought nothing).
_UNROLL = 4

# Threads of the grid-stride loop of the unordered (atomic) fallback on a GPU.
_GPU_STRIDE_THREADS = 1 << 17

_FLOATS = {"float32": wp.float32, "float64": wp.float64}

_SOURCES = {}  # kernel name -> its Python function (see _kernels)


def _deferred(function, name=None):
    """Register the kernel `_NAME_kernel` (or a factory's kernel, then so named) under NAME, to
    become a Warp kernel on first use."""
    if name is not None:
        function.__name__ = function.__qualname__ = f"_{name}_kernel"
    _SOURCES[function.__name__.removeprefix("_").removesuffix("_kernel")] = function
    return function


@wp.func
def _segment_range(offsets: wp.array(dtype=wp.int32), s: int, n: int):
    lo = wp.clamp(offsets[s], 0, n)
    hi = wp.clamp(offsets[s + 1], lo, n)
    return lo, hi


@_deferred
def _layout_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # One thread per segment: binary search for the first id >= s. (On a GPU this beats a
    # thread per row writing the offsets at each boundary: 17 µs against 39 at N = 10⁷.)
    s = wp.tid()
    lo = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    hi = idx.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if idx[mid] < s:
            lo = mid + 1
        else:
            hi = mid
    out[s] = lo


# CPUs: the offsets at the boundaries of a run of 4 ids. Thread t takes ids 4t..4t+3 and,
# for each i of them, writes out[s] = i for the s in (c(idx[i - 1]), c(idx[i])], c clamping to
# [-1, M] (c(idx[-1]) = -1); the thread holding the last id writes N from there to M.
# Meaningful for clamped ids non-decreasing, the only case that uses the offsets. (2 Mi ids
# on a 2-core VM: 2.9-3.0 ms, where one thread walking them took 4.5-4.6 and a binary search
# per segment 4.6-4.7; benchmarks/layout.py.)
_LAYOUT_RUN = """
    const int* p = (const int*)idx.data;
    int* o = (int*)out.data;
    const int n = idx.shape[0], m = out.shape[0] - 1, i0 = 4 * t;
    if (i0 >= n) {  /* no ids: every offset 0 */
        for (int s = 0; t == 0 && s <= m; s++) o[s] = 0;
        return 0;
    }
    auto clamped = [m](int id) { return id < -1 ? -1 : id > m ? m : id; };
    int before = i0 == 0 ? -1 : clamped(p[i0 - 1]);
    for (int i = i0; i < i0 + 4 && i < n; i++) {
        const int c = clamped(p[i]);
        for (int s = before + 1; s <= c; s++) o[s] = i;
        before = c > before ? c : before;
    }
    if (i0 + 4 >= n)
        for (int s = before + 1; s <= m; s++) o[s] = n;
    return 0;
"""


@wp.func_native(_LAYOUT_RUN)
def _layout_run(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32), t: int) -> int:
    ...


@_deferred
def _layout_runs_kernel(idx: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # a thread per run of 4 ids (see _LAYOUT_RUN), launched (max(1, ceil(N / 4)),)
    _layout_run(idx, out, wp.tid())


@wp.func_native("""
    int* p = (int*)out.data;
    for (int i = lo; i < hi; i++) p[i] = id;
""")
def _fill_ids(out: wp.array(dtype=wp.int32), lo: int, hi: int, id: int): ...


@_deferred
def _segment_ids_kernel(offsets: wp.array(dtype=wp.int32), out: wp.array(dtype=wp.int32)):
    # a thread per run of rows of one id, launched (M + 2,): thread 0 the rows ahead of
    # offsets[0] (-1), thread t in 1..M those of segment t - 1, thread M + 1 those from
    # offsets[M] on (M); offsets non-decreasing, clamped to [0, N]. (2 Mi rows in 65 Ki
    # segments on a 2-core VM: 3.1 ms by a loop in Warp, 1.2 ms in C, as NumPy's repeat.)
    t = wp.tid()
    m = offsets.shape[0] - 1
    n = out.shape[0]
    lo = int(0)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    hi = n
    if t > 0:
        lo = wp.clamp(offsets[t - 1], 0, n)
    if t <= m:
        hi = wp.clamp(offsets[t], lo, n)
    _fill_ids(out, lo, hi, t - 1)


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


@wp.func
def _squared_entry(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any),
                   i: int, s: int, p: int):
    v = a[i, p]
    return v * v


# C for one CPU thread's vector lanes ("float" stands for the dtype): lanes8, the masks of
# their comparisons (mask8), `lane` (0..7), sum8 (the 8 lanes added as a GPU's butterfly adds
# them) and sum24 (the 24 lanes of three vectors added so, each feature's 8 apart);
# the compiler, left to itself, vectorizes such sums badly.
_LANES8 = """
    typedef float lanes8 __attribute__((vector_size(8 * sizeof(float))));
    typedef decltype(lanes8{} != lanes8{}) mask8;
    const mask8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    auto sum8 = [](lanes8 v) {
        return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    };
    auto sum24 = [](const lanes8* v, int f) {
        float part[24];
        __builtin_memcpy(part, v, sizeof part);
        return ((part[f] + part[f + 12]) + (part[f + 6] + part[f + 18])) +
               ((part[f + 3] + part[f + 15]) + (part[f + 9] + part[f + 21]));
    };
"""

# C: rows8(rows, n, i, &a, &b, &c) loads rows i..i+7 of 3 entries of `rows` (n rows) as 24
# entries in three vectors, never reading past row n (those past it 0); with _LANES8.
_ROWS8 = """
    auto rows8 = [](const float* rows, int n, int i, lanes8* a, lanes8* b, lanes8* c) {
        const float* p = rows + 3LL * i;
        float padded[24] = {};
        if (i + 8 > n) {
            __builtin_memcpy(padded, p, (n - i) * 3 * sizeof(float));
            p = padded;
        }
        __builtin_memcpy(a, p, sizeof *a);
        __builtin_memcpy(b, p + 8, sizeof *b);
        __builtin_memcpy(c, p + 16, sizeof *c);
    };
"""

# C for rows lo:hi of 3 entries of `rows` (n rows), with _LANES8 and _ROWS8: sum3(w), their Σ
# each times w, by one thread (CPUs): 8 rows (24 entries) at a time into three vectors of
# partial sums, the entries past hi masked (no scalar tail, no branch on the segment's
# length), added by sum24; mean3(total), their mean from their plain sum `total`: total /
# count, rounded once, in each entry where the sum is finite, else Σ v · (1/count), no partial
# sum of which overflows (summed again only where some entry needs it).
_SUM3_MEAN3 = """
    auto sum3 = [&](float w) {
        lanes8 sums[3] = {};
        for (int i = lo; i < hi; i += 8) {
            lanes8 v[3];
            rows8(rows, n, i, &v[0], &v[1], &v[2]);
            for (int k = 0; k < 3; k++)
                sums[k] = lane + 8 * k < 3 * (hi - i) ? sums[k] + v[k] * w : sums[k];
        }
        return wp::vec_t<3, float>(sum24(sums, 0), sum24(sums, 1), sum24(sums, 2));
    };
    auto mean3 = [&](wp::vec_t<3, float> total) {
        const float count = (float)(hi - lo > 1 ? hi - lo : 1);
        const bool finite = __builtin_isfinite(total[0]) && __builtin_isfinite(total[1]) &&
                            __builtin_isfinite(total[2]);
        const wp::vec_t<3, float> scaled = finite ? total : sum3((float)1 / count);
        wp::vec_t<3, float> out;
        for (int d = 0; d < 3; d++)
            out[d] = __builtin_isfinite(total[d]) ? total[d] / count : scaled[d];
        return out;
    };
"""

# Σ of rows lo:hi of 3 entries of a, or with `mean` their mean (see _SUM3_MEAN3)
_ROWS3_SUM = _LANES8 + _ROWS8 + """
    const float* rows = (const float*)a.data;
    const int n = a.shape[0];
""" + _SUM3_MEAN3 + """
    const wp::vec_t<3, float> total = sum3(1);
    return mean ? mean3(total) : total;
"""


@wp.func_native(_ROWS3_SUM)
def _rows3_sum(a: wp.array2d(dtype=wp.vec3f), lo: int, hi: int, mean: int) -> wp.vec3f:
    ...


@wp.func_native(_ROWS3_SUM.replace("float", "double"))
def _rows3_sum(a: wp.array2d(dtype=wp.vec3d), lo: int, hi: int, mean: int) -> wp.vec3d:
    ...


# The reductions; sum3 and mean3 (CPUs only) sum rows of vec3 by _rows3_sum.
# mean: on the ordered path the sum / count where finite, else Σ a · (1/count) (no partial sum
# overflows); on the atomic path the plain sum (_mean finishes it).
for _name, _term in (("count", _one), ("sum", _entry), ("sum3", _entry), ("outer", _outer_entry),
                     ("mean", _entry), ("mean3", _entry),
                     ("sum_squares", _squared_entry)):
    _deferred(_segment_reduction(_term, rows=_rows3_sum if _name.endswith("3") else None,
                                 mean=_name.startswith("mean")), _name)


@wp.func
def _group_square(a: wp.array2d(dtype=Any), b: wp.array2d(dtype=Any), out: wp.array2d(dtype=Any),
                  i: int, s: int, p: int):
    # |x[i, p]|² of a = x (N, G·K) flat over its groups, out (M, G)
    k = a.shape[1] // out.shape[1]
    acc = a.dtype(0.0)
    for j in range(p * k, (p + 1) * k):
        acc += a[i, j] * a[i, j]
    return acc


# rms_norm's Σ|x|² for ids not ordered (rms_norm_span takes the ordered ones)
_deferred(_segment_reduction(_group_square, ordered_path=False), "rms_norm_squares")


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


@_deferred
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


@_deferred
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


@_deferred
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

# Lanes of max_norm's search (max_norm_lanes) by dtype: a group takes 16 rows of 3 a pass (its
# lanes' blocks of 4 float32 rows or 2 float64 rows). On an H100 at N = 10⁷, float32 by 4
# lanes 70.6–71.7 µs against 77.8–84.1 by 8; float64 by 8 lanes 111.5 µs against 119.3 by 4
# (benchmarks/RESULTS.md).
MAX_NORM_LANES = {"float32": 4, "float64": 8}


def lane_grid(groups, gpu, lanes=LANES):
    """(threads a group, launch dims) of a flat launch of `groups` groups of lanes: `lanes` on
    GPUs (1 on CPUs), halved while the launch would pass 2³¹ - 1 threads (Warp's thread index
    is an int)."""
    lanes = lanes if gpu else 1
    while lanes > 1 and groups * lanes >= 2**31:
        lanes //= 2
    return lanes, (groups * lanes,)


_LANES_HERE = """
#if defined(__CUDA_ARCH__)
    return lanes;
#else
    return 1;
#endif
"""

_LANE_XOR = """
#if defined(__CUDA_ARCH__)
    unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    return __shfl_xor_sync(mask, v, offset, lanes);
#else
    return v;
#endif
"""

# Σ x[e] · f · y[e] over the entries e = lane, lane + lanes, ... of segment rows lo:hi and
# group g (of `groups`, `k` features each), in order ("float" stands for the dtype: Warp's
# float() and double() are macros, so no cast is spelled with them)
_SPAN_SUM = """
    float acc = 0;
    const float* p = (const float*)x.data;
    const float* q = (const float*)y.data;
    if (groups == 1) {  /* entries lo·k .. hi·k (< 2³¹: Warp's shapes are int) */
#if defined(__CUDA_ARCH__)
        if (p == q && f == 1) {  /* Σ x²: each entry loaded once, the product by 1 left out
                                    (the same bits) */
            #pragma unroll 4
            for (int e = lo * k + lane; e < hi * k; e += lanes) {
                const float v = p[e];
                acc += v * v;
            }
        } else {
            #pragma unroll 4
            for (int e = lo * k + lane; e < hi * k; e += lanes) acc += p[e] * f * q[e];
        }
#else
        /* one thread: the sums of LANES = 8 lanes side by side (a CPU's vector lanes), the
           entries past hi masked, added as the GPU's butterfly adds them */
        LANES8
        auto load8 = [&](const float* data, int e) {  /* none past x's end */
            lanes8 v = {};
            if (e + 8 <= x.shape[0])
                __builtin_memcpy(&v, data + e, sizeof v);
            else
                __builtin_memcpy(&v, data + e, (x.shape[0] - e) * sizeof(float));
            return v;
        };
        lanes8 part = {};
        for (int e = lo * k; e < hi * k; e += 8) {
            const lanes8 u = load8(p, e), v = load8(q, e);
            part = lane < hi * k - e ? part + u * f * v : part;
        }
        acc = sum8(part);
#endif
    } else {
        for (int e = lane; e < (hi - lo) * k; e += lanes) {
            const int i = lo + e / k;
            const int at = (i * groups + g) * k + (e - (i - lo) * k);
            acc += p[at] * f * q[at];
        }
    }
    return acc;
""".replace("LANES8", _LANES8)  # its `lane` the vector's, where the thread's is 0


# A kernel of groups of lanes is launched flat, (groups · lanes,), and splits its thread's index
# itself: Warp's own (groups, lanes) launch unravels every index by a 64-bit division and
# modulo. ncu on an H100 (max_norm_lanes, float32, N = 10⁷): 55.6 → 44.4 M instructions, 92 →
# 78.5 µs (benchmarks/RESULTS.md).
_LANE_SHIFT = """
#if defined(__CUDA_ARCH__)
    return __ffs(lanes) - 1;
#else
    return __builtin_ctz((unsigned int)lanes);
#endif
"""


@wp.func_native(_LANE_SHIFT)
def _lane_shift(lanes: int) -> int:
    """log2 of `lanes`, a power of two."""
    ...


@wp.func
def _lane_split(i: int, lanes: int):
    # (group, lane) of thread i of a flat launch of groups of `lanes` threads
    return i >> _lane_shift(lanes), i & (lanes - 1)


@wp.func_native(_LANES_HERE)
def _lanes_here(lanes: int) -> int:
    """The lanes of a group where the kernel runs: `lanes` on GPUs, 1 on CPUs."""
    ...


@wp.func_native(_LANE_XOR)
def _lane_xor(v: wp.float32, offset: int, lanes: int) -> wp.float32:
    """v of lane (this lane XOR offset) of the group (CPUs: one lane, v itself)."""
    ...


@wp.func_native(_LANE_XOR)
def _lane_xor(v: wp.float64, offset: int, lanes: int) -> wp.float64:  # an overload per dtype
    ...



_SYNC_LANES = """
#if defined(__CUDA_ARCH__)
    unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    __syncwarp(mask);
#endif
"""


@wp.func_native(_SYNC_LANES)
def _sync_lanes(lanes: int):
    """Waits for every lane of the group, whose memory writes before are then seen by all
    (CPUs: one lane, nothing to wait for)."""
    ...


@wp.func_native(_SPAN_SUM)
def _span_sum(x: wp.array(dtype=wp.float32), y: wp.array(dtype=wp.float32), lo: int, hi: int,
              g: int, groups: int, k: int, lane: int, lanes: int, f: wp.float32) -> wp.float32:
    ...


@wp.func_native(_SPAN_SUM.replace("float", "double"))
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


@wp.func
def _root_mean(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, total: Any):
    # the RMS norm of rows lo:hi from their Σ|x|² (0 if none; see _rms_of_squares)
    if lo < hi:
        return _rms_of_squares(x, lo, hi, g, total)
    return x.dtype(0.0)


@wp.func
def _total(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, total: Any):
    return total


_deferred(_span_reduction(_root_mean), "rms_norm_span")  # a = b = x
_deferred(_span_reduction(_total), "dot_span")


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
    # the same (shift, Σ) in each lane (see _lanes_mean for why two functions)
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


# C: both passes over rows lo:hi of 3 entries of x (N, 3) by one thread (CPUs), 8 rows (24
# entries) at a time in vector lanes as _ROWS3_SUM takes them, into out[s] (M, 3, 2); only
# thread p = 0 of the segment works, and each returns 1 (0 where x is not (N, 3): nothing
# done). "float" stands for the dtype. ROWS3_TWO_PASSES is completed by FIRST (after the
# first pass's lanes `firsts`, each entry's value `first[c]`, and the lanes `centre` holding
# them in the rows' layout) and SECOND (each lane's term of the second pass from v[k] and
# centre[k]), both summed (sum24), then REDO (what redoes the second pass's sums where its
# lanes could not).
_ROWS3_TWO_PASSES = """
    if (x.shape[1] != 3) return 0;
    if (p != 0) return 1;
    const float* rows = (const float*)x.data;
    const int n = x.shape[0];
    const float count = (float)(hi - lo > 1 ? hi - lo : 1);
    lanes8 firsts[3], seconds[3] = {}, centre[3];
    for (int k = 0; k < 3; k++) firsts[k] = lanes8{} + START;
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * (hi - i);
            firsts[k] = inside ? FOLD : firsts[k];
        }
    }
    float first[3];
    FIRST
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = first[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * (hi - i);
            const lanes8 term = SECOND;
            seconds[k] = inside ? seconds[k] + term : seconds[k];
        }
    }
    REDO
    float* o = (float*)out.data + 6LL * s;
    for (int c = 0; c < 3; c++) {
        o[2 * c] = first[c];
        o[2 * c + 1] = sum24(seconds, c) DIVIDE;
    }
    return 1;
"""

# the mean (Σ x / count, as sum24 adds the lanes), then Σ (x - mean)² / count
_MOMENTS3 = _LANES8 + _ROWS8 + (
    _ROWS3_TWO_PASSES.replace("START", "0").replace("FOLD", "firsts[k] + v[k]")
    .replace("FIRST", "for (int c = 0; c < 3; c++) first[c] = sum24(firsts, c) / count;")
    .replace("SECOND", "(v[k] - centre[k]) * (v[k] - centre[k])")
    .replace("DIVIDE", "/ count").replace("REDO", ""))

# C: exp8(x), e^x in each of 8 lanes where x is in [LOW, HIGH] (each lane outside marked in
# `unplain`, for the caller to redo): x = n ln2 + r, |r| <= ln2/2 (n by rounding x/ln2, ln2
# in two parts), e^r by its Taylor polynomial (to degree 7 for float32, 13 for float64, by
# Estrin's scheme), times 2^n made of its bits; every step a multiply-add (fma8: 22–28 %
# faster than separate products and sums, which the kernels' compiler does not fuse). Within
# 2 units in the last place (tested against NumPy's exp).
_EXP8 = """
    auto fma8 = [](lanes8 a, lanes8 b, lanes8 c) { return __builtin_elementwise_fma(a, b, c); };
    auto splat = [](float v) { return lanes8{} + v; };
    mask8 unplain = {};
    auto exp8 = [&](lanes8 x) {
        const mask8 plain = (x >= LOW) & (x <= HIGH);
        unplain |= ~plain;
        const lanes8 clamped = plain ? x : 0;
        const lanes8 n = fma8(clamped, splat(LOG2E), splat(ROUND)) - ROUND;
        const lanes8 r = fma8(-n, splat(LN2_LOW), fma8(-n, splat(LN2_HIGH), clamped));
        POLYNOMIAL
        const mask8 bits = (__builtin_convertvector(n, mask8) + BIAS) << MANTISSA;
        lanes8 scale;
        __builtin_memcpy(&scale, &bits, sizeof scale);
        return p * scale;
    };
"""

# C: first[c], the shift of entry c: the largest value of its lanes `firsts` (NaN passed
# over) where finite, else 0
_SHIFTS = """
    float tops[24];
    __builtin_memcpy(tops, firsts, sizeof tops);
    for (int c = 0; c < 3; c++) {
        float top = tops[c];
        for (int e = c + 3; e < 24; e += 3) top = tops[e] > top ? tops[e] : top;
        first[c] = __builtin_isfinite(top) ? top : 0;
    }
"""

# the largest value of each entry (NaN passed over), shifted by it where finite
_EXP_SUMS3 = _LANES8 + _ROWS8 + _EXP8 + (_ROWS3_TWO_PASSES
              .replace("START", "-(float)__builtin_inf()")
              .replace("FOLD", "v[k] > firsts[k] ? v[k] : firsts[k]")
              .replace("FIRST", _SHIFTS)
              .replace("SECOND", "exp8(inside ? v[k] - centre[k] : 0)")
              .replace("DIVIDE", "")
              .replace("REDO", """
    if (__builtin_reduce_or(unplain)) {  /* a difference beyond exp8's range: wp::exp's */
        float sums[3] = {};
        for (int i = lo; i < hi; i++)
            for (int c = 0; c < 3; c++) sums[c] += wp::exp(rows[3LL * i + c] - first[c]);
        for (int k = 0; k < 3; k++) seconds[k] = lanes8{};
        for (int c = 0; c < 3; c++) seconds[0][c] = sums[c];  /* entry c's lane */
    }"""))


def _polynomial(coefficients):
    """C statements leaving Σ coefficients[j] · r^j in `p` by Estrin's scheme (pairs of terms,
    then pairs of pairs by r², r⁴, ..., each a multiply-add)."""
    terms = [f"fma8(splat({b}), r, splat({a}))"
             for a, b in zip(coefficients[::2], coefficients[1::2])]
    terms += coefficients[len(coefficients) // 2 * 2:]
    lines, power = ["const lanes8 r2 = r * r;"], 2
    while len(terms) > 1:
        pairs = [f"fma8({b}, r{power}, {a})" for a, b in zip(terms[::2], terms[1::2])]
        names = [f"t{power}_{j}" for j in range(len(pairs))]
        lines += [f"const lanes8 {name} = {pair};" for name, pair in zip(names, pairs)]
        terms = names + terms[len(pairs) * 2:]
        if len(terms) > 1:
            lines.append(f"const lanes8 r{2 * power} = r{power} * r{power};")
            power *= 2
    return "\n".join([*lines, f"const lanes8 p = {terms[0]};"])


def _c_literal(value, dtype):
    """`value` rounded to `dtype` ("float32" or "float64") as an exact C literal."""
    return float(np.dtype(dtype).type(value)).hex() + ("f" if dtype == "float32" else "")


def _source_for(source, dtype, constants):
    """C `source` for `dtype` ("float32" or "float64"): "float" its C type, and each name of
    `constants` replaced by its value (a string, or a number as an exact literal)."""
    source = source if dtype == "float32" else source.replace("float", "double")
    for name in sorted(constants, key=len, reverse=True):  # LN2_HIGH before HIGH
        value = constants[name]
        source = source.replace(name, value if isinstance(value, str) else _c_literal(value, dtype))
    return source


def _lanes_source(source, dtype):
    """`source` (C in vector lanes) for `dtype` ("float32" or "float64"): "float" its C type,
    and exp8's constants, where it holds _EXP8, exact C literals."""
    single = dtype == "float32"
    degree = 7 if single else 13
    ln2_high = 0.693359375 if single else float.fromhex("0x1.62e42fee00000p-1")
    constants = {
        "LOW": -87 if single else -708, "HIGH": 88 if single else 709, "LOG2E": 1 / math.log(2),
        "ROUND": 1.5 * 2.0 ** (23 if single else 52), "LN2_HIGH": ln2_high,
        "LN2_LOW": math.log(2) - ln2_high,
        "BIAS": "127" if single else "1023", "MANTISSA": "23" if single else "52",
    }
    source = source.replace("POLYNOMIAL", _polynomial(
        [_c_literal(1 / math.factorial(j), dtype) for j in range(degree + 1)]))
    return _source_for(source, dtype, constants)


@wp.func_native(_lanes_source(_MOMENTS3, "float32"))
def _moments3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int, s: int, p: int,
              out: wp.array3d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_lanes_source(_MOMENTS3, "float64"))
def _moments3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int, s: int, p: int,
              out: wp.array3d(dtype=wp.float64)) -> int:
    ...


@wp.func_native(_lanes_source(_EXP_SUMS3, "float32"))
def _exp_sums3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int, s: int, p: int,
               out: wp.array3d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_lanes_source(_EXP_SUMS3, "float64"))
def _exp_sums3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int, s: int, p: int,
               out: wp.array3d(dtype=wp.float64)) -> int:
    ...


# C: the softmax of rows lo:hi of 3 entries of x (N, 3) into the same rows of out, by one
# thread (CPUs), 8 rows at a time in vector lanes: each entry's shift (as _EXP_SUMS3 finds
# it), its exponentials by exp8 written out and summed, then divided by their sum (0 where it
# is 0); wp::exp's exponentials where a difference is beyond exp8's range. "float" stands for
# the dtype.
_SOFTMAX3 = _LANES8 + _ROWS8 + _EXP8 + """
    auto put8 = [](float* dest, int i, int hi, const lanes8* v) {  /* rows i.. of the block */
        if (hi - i >= 8)
            __builtin_memcpy(dest + 3LL * i, v, 24 * sizeof(float));
        else
            __builtin_memcpy(dest + 3LL * i, v, 3 * (hi - i) * sizeof(float));
    };
    const float* rows = (const float*)x.data;
    float* dest = (float*)out.data;
    const int n = x.shape[0];
    lanes8 firsts[3], seconds[3] = {}, centre[3];
    for (int k = 0; k < 3; k++) firsts[k] = lanes8{} - (float)__builtin_inf();
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * (hi - i);
            firsts[k] = (inside & (v[k] > firsts[k])) ? v[k] : firsts[k];
        }
    }
    float first[3];
""" + _SHIFTS + """
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = first[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * (hi - i);
            v[k] = exp8(inside ? v[k] - centre[k] : 0);
            seconds[k] = inside ? seconds[k] + v[k] : seconds[k];
        }
        put8(dest, i, hi, v);
    }
    float totals[3];
    for (int c = 0; c < 3; c++) totals[c] = sum24(seconds, c);
    if (__builtin_reduce_or(unplain)) {  /* a difference beyond exp8's range: wp::exp's */
        for (int c = 0; c < 3; c++) totals[c] = 0;
        for (long long e = 3LL * lo; e < 3LL * hi; e++) {
            dest[e] = wp::exp(rows[e] - first[e % 3]);
            totals[e % 3] += dest[e];
        }
    }
    for (int k = 0; k < 3; k++)  /* 1 / Σ (0 where Σ is 0) */
        for (int l = 0; l < 8; l++)
            centre[k][l] = totals[(8 * k + l) % 3] != 0 ? 1 / totals[(8 * k + l) % 3] : 0;
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) v[k] = v[k] * centre[k];
        put8(dest, i, hi, v);
    }
    TANGENT
    return 0;
"""

# softmax's tangent along dx (N, 3) from the softmax s its rows hold: s (dx - Σ s dx), each
# entry's Σ over the segment (sum24 of the lanes)
_SOFTMAX3_TANGENT = _SOFTMAX3.replace("TANGENT", """
    const float* along = (const float*)dx.data;
    lanes8 dots[3] = {};
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3], d[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        rows8(along, n, i, &d[0], &d[1], &d[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * (hi - i);
            dots[k] = inside ? dots[k] + v[k] * d[k] : dots[k];
        }
    }
    for (int c = 0; c < 3; c++) totals[c] = sum24(dots, c);
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 8; l++) centre[k][l] = totals[(8 * k + l) % 3];
    for (int i = lo; i < hi; i += 8) {
        lanes8 v[3], d[3];
        rows8(dest, n, i, &v[0], &v[1], &v[2]);
        rows8(along, n, i, &d[0], &d[1], &d[2]);
        for (int k = 0; k < 3; k++) v[k] = v[k] * (d[k] - centre[k]);
        put8(dest, i, hi, v);
    }""")
_SOFTMAX3 = _SOFTMAX3.replace("TANGENT", "")


@wp.func_native(_lanes_source(_SOFTMAX3, "float32"))
def _softmax3(x: wp.array2d(dtype=wp.float32), lo: int, hi: int,
              out: wp.array2d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_lanes_source(_SOFTMAX3, "float64"))
def _softmax3(x: wp.array2d(dtype=wp.float64), lo: int, hi: int,
              out: wp.array2d(dtype=wp.float64)) -> int:
    ...


@wp.func_native(_lanes_source(_SOFTMAX3_TANGENT, "float32"))
def _softmax3_tangent(x: wp.array2d(dtype=wp.float32), dx: wp.array2d(dtype=wp.float32), lo: int,
                      hi: int, out: wp.array2d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_lanes_source(_SOFTMAX3_TANGENT, "float64"))
def _softmax3_tangent(x: wp.array2d(dtype=wp.float64), dx: wp.array2d(dtype=wp.float64), lo: int,
                      hi: int, out: wp.array2d(dtype=wp.float64)) -> int:
    ...


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


_deferred(_rows3_or_zeros(_softmax_rows3), "softmax3")
_deferred(_rows3_or_zeros(_softmax_tangent_rows3), "softmax3_tangent")


# var and std (moments: mean, variance), logsumexp and softmax (exp_sums: shift, Σ exp); on
# CPUs rows of 3 in vector lanes (moments3, exp_sums3)
for _name, _segment, _first, _rows3 in (("moments", _mean_and_variance, _add_and_count, _moments3),
                                        ("exp_sums", _shift_and_exp_sum, _raise_top, _exp_sums3)):
    _deferred(_two_passes(_segment, _first), _name)
    _deferred(_two_passes(_segment, _first, _rows3), f"{_name}_cpu")
_deferred(_atomic_pass(_squared_deviation), "centered_squares")
_deferred(_atomic_pass(_shifted_exp), "shifted_exp_sums")


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


_deferred(_segment_groups(_variance_sum), "variance_tangent")
_deferred(_segment_groups(_variance_rows), "variance_cotangent")


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


# std's tangent, cotangent and weighted second derivative (see _primitives.std_tangent_p)
_deferred(_segment_groups(_std_sum), "std_tangent")
_deferred(_segment_groups(_std_rows), "std_cotangent")
_deferred(_segment_groups(_std_curvature), "std_curvature")


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


# softmax's tangent along a: q = a; its curvature along a and b (the second derivative, a
# symmetric bilinear map): q = (a - Σ e a)(b - Σ e b)
_deferred(_segment_groups(_softmax_rows(_no_means, _row_of_a)), "softmax_tangent")
_deferred(_segment_groups(_softmax_rows(_softmax_means, _centred_product)), "softmax_curvature")


# out[e] = (x[e] · a) · b, plus (y[e] · a) · c if `paired`, over the entries e = lane, lane +
# lanes, ... of segment rows lo:hi and group g (of `groups`, `k` features each), x, y and out
# flat: the bits of the scale kernels (each product a statement of its own, as Warp writes
# them); a plain loop over the span where G = 1, which a CPU's compiler vectorizes ("float"
# stands for the dtype, as in _SPAN_SUM)
_SPAN_SCALED = """
    const float* p = (const float*)x.data;
    const float* q = (const float*)y.data;
    float* o = (float*)out.data;
    auto put = [&](int at) {
        float v = p[at] * a;
        v = v * b;
        if (paired) {
            float w = q[at] * a;
            w = w * c;
            v = v + w;
        }
        o[at] = v;
    };
    if (groups == 1) {
        for (int e = lo * k + lane; e < hi * k; e += lanes) put(e);
    } else {
        for (int e = lane; e < (hi - lo) * k; e += lanes) {
            const int i = lo + e / k;
            put((i * groups + g) * k + (e - (i - lo) * k));
        }
    }
    return 0;
"""


@wp.func_native(_SPAN_SCALED)
def _span_scaled(x: wp.array(dtype=wp.float32), y: wp.array(dtype=wp.float32),
                 out: wp.array(dtype=wp.float32), lo: int, hi: int, g: int, groups: int, k: int,
                 lane: int, lanes: int, a: wp.float32, b: wp.float32, c: wp.float32,
                 paired: int) -> int:
    ...


@wp.func_native(_SPAN_SCALED.replace("float", "double"))
def _span_scaled(x: wp.array(dtype=wp.float64), y: wp.array(dtype=wp.float64),
                 out: wp.array(dtype=wp.float64), lo: int, hi: int, g: int, groups: int, k: int,
                 lane: int, lanes: int, a: wp.float64, b: wp.float64, c: wp.float64,
                 paired: int) -> int:  # an overload per dtype
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
def _group_of(offsets: wp.array(dtype=wp.int32), t: int, groups: int, n: int):
    # (s, g, lo, hi): the segment and group of lane group t (of M·G) and the segment's rows
    s = t // groups
    lo, hi = _segment_range(offsets, s, n)
    return s, t - s * groups, lo, hi


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


_deferred(_rms_norm_rows(False), "rms_norm_cotangent_span")
_deferred(_rms_norm_rows(True), "rms_norm_curvature_span")


@_deferred
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
def _is_nan(v: wp.float32):
    return wp.isnan(v)


@wp.func
def _is_nan(v: wp.float64):  # an overload per dtype (integers are never NaN)
    return wp.isnan(v)


@wp.func
def _is_nan(v: wp.int32):
    return False


@wp.func
def _is_nan(v: wp.int64):
    return False


@wp.func
def _value(x: wp.array3d(dtype=Any), i: int, g: int):
    return x[i, g, 0]


@wp.func
def _above(candidate: Any, best: Any):
    return candidate > best


@wp.func
def _below(candidate: Any, best: Any):
    return candidate < best


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
# |x[i, g, k]| (its factors unused), then the atomic sum of |x[i, g] * inverse[s, g]|².
_deferred(_overflow_rescue(_largest_entry_of, _atomic_above), "rms_norm_top")
_deferred(_overflow_rescue(_scaled_squared_norm, _atomic_sum), "rms_norm_rescaled")


@wp.func
def _weighted_entry(x: wp.array3d(dtype=Any), i: int, g: int, factor: Any):
    return x[i, g, 0] * factor


@wp.func
def _not_finite(total: Any):
    return not wp.isfinite(total)


# mean of unordered ids whose plain sum is not finite: Σ x[i] · (1/count) over those segments
# (x (N, K, 1), factors 1/count (M, K)), no partial sum of which overflows
_deferred(_overflow_rescue(_weighted_entry, _atomic_sum, _not_finite), "mean_rescued")


@_deferred
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


def _ordered_search(key, better, screen=None, unroll=True):
    """The ordered search of _extreme: search(x, lo, hi, g), the first of rows lo:hi (lo < hi)
    of group g attaining the best key(x, i, g), `better` ordering keys and NaN beating any
    number. With `screen` (max_norm's squared norm), a row whose screen(x, i, g) is no larger
    than a plain one (see _plain_square) of a row already taken cannot be larger either, and
    its key is not computed. With `unroll`, _UNROLL rows are prepared together, else a row at
    a time."""

    @wp.func
    def beats(v: Any, i: int, winner: int, top: Any):
        # (winner, top) after row i with key v, in order: a better key or the first NaN wins
        if better(v, top) or (_is_nan(v) and not _is_nan(top)):
            return i, v
        return winner, top

    prepare = key if screen is None else screen  # what the search reads of a row first

    if screen is None:
        @wp.func
        def take(x: wp.array3d(dtype=Any), i: int, g: int, prepared: Any, winner: int, top: Any,
                 bound: Any):
            # (winner, top, bound) after row i, whose key is `prepared`
            winner, top = beats(prepared, i, winner, top)
            return winner, top, bound
    else:
        @wp.func
        def take(x: wp.array3d(dtype=Any), i: int, g: int, prepared: Any, winner: int, top: Any,
                 bound: Any):
            # (winner, top, bound) after row i, whose screen is `prepared`; `bound` the largest
            # plain screen of the rows taken so far (NaN and non-plain screens never compare
            # as no larger)
            if prepared <= bound:
                return winner, top, bound
            winner, top = beats(key(x, i, g), i, winner, top)
            if _plain_square(prepared):
                bound = wp.max(bound, prepared)
            return winner, top, bound

    @wp.func
    def search(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int):
        # the first row of lo:hi (lo < hi) attaining the best key
        top = key(x, lo, g)
        winner = int(lo)
        bound = x.dtype(-1)  # no plain screen yet: nothing is skipped
        i = int(lo + 1)
        if wp.static(unroll):
            while i + _UNROLL <= hi:  # 4 rows prepared together, then taken in order
                p0 = prepare(x, i, g)
                p1 = prepare(x, i + 1, g)
                p2 = prepare(x, i + 2, g)
                p3 = prepare(x, i + 3, g)
                winner, top, bound = take(x, i, g, p0, winner, top, bound)
                winner, top, bound = take(x, i + 1, g, p1, winner, top, bound)
                winner, top, bound = take(x, i + 2, g, p2, winner, top, bound)
                winner, top, bound = take(x, i + 3, g, p3, winner, top, bound)
                i += _UNROLL
        while i < hi:
            winner, top, bound = take(x, i, g, prepare(x, i, g), winner, top, bound)
            i += 1
        return winner

    return search


def _extreme(key, better, atomic_better, screen=None, shortcut=None):
    """The kernels finding, per segment s and group g, the first row i attaining the best
    key(x, i, g), `better` ordering keys and NaN beating any number (so a NaN row is chosen):
    `first` (M, G) int32, left as given (N) for an empty segment.

    Ordered ids: one thread per (s, g) over the segment's rows (_ordered_search, `screen`
    there). Otherwise `best` (filled with the worst key) takes the atomic best of the keys,
    NaN entering as `nan_key[0]` (the best possible key), and then `first` the atomic min of
    the rows attaining it. `shortcut`, if given, makes the ordered search from this one, the
    key and `better` (see _largest_square_first, _first_by_plain_comparisons)."""

    search = _ordered_search(key, better, screen)
    if shortcut is not None:
        search = shortcut(search, key, better)

    @wp.func
    def atomic_key(x: wp.array3d(dtype=Any), i: int, g: int, nan_key: wp.array(dtype=Any)):
        # The key as the atomic path compares it: NaN enters as the best possible key.
        v = key(x, i, g)
        if _is_nan(v):
            v = nan_key[0]
        return v

    def ordered_kernel(
        x: wp.array3d(dtype=Any),
        offsets: wp.array(dtype=wp.int32),
        ordered: wp.array(dtype=wp.int32),
        out: wp.array2d(dtype=wp.int32),
    ):
        # where the ids are ordered, each out[s, g] (N for an empty segment), else left as given
        s, g = wp.tid()
        if ordered[0] != 0:
            lo, hi = _segment_range(offsets, s, x.shape[0])
            if lo < hi:
                out[s, g] = search(x, lo, hi, g)
            else:
                out[s, g] = x.shape[0]

    def best_kernel(
        x: wp.array3d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        ordered: wp.array(dtype=wp.int32),
        stride: int,
        nan_key: wp.array(dtype=Any),
        best: wp.array2d(dtype=Any),
    ):
        t, g = wp.tid()
        if ordered[0] == 0:
            for i in range(t, x.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < best.shape[0]:
                    atomic_better(best, s, g, atomic_key(x, i, g, nan_key))

    def first_kernel(
        x: wp.array3d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        ordered: wp.array(dtype=wp.int32),
        stride: int,
        nan_key: wp.array(dtype=Any),
        best: wp.array2d(dtype=Any),
        first: wp.array2d(dtype=wp.int32),
    ):
        t, g = wp.tid()
        if ordered[0] == 0:
            for i in range(t, x.shape[0], stride):
                s = idx[i]
                if s >= 0 and s < best.shape[0]:  # noqa: SIM102  (best[s, g] only in range)
                    if atomic_key(x, i, g, nan_key) == best[s, g]:
                        wp.atomic_min(first, s, g, i)

    return ordered_kernel, best_kernel, first_kernel


# max and min per entry (x as (N, entries, 1)), max_norm per group of features (whose ordered
# search on GPUs is max_norm_lanes, below).
for _name, _parts in (("max", (_value, _above, _atomic_above)),
                      ("min", (_value, _below, _atomic_below)),
                      ("max_norm", (_norm, _above, _atomic_above))):
    for _step, _kernel in zip(("ordered", "best", "first"), _extreme(*_parts)):
        if (_name, _step) != ("max_norm", "ordered"):
            _deferred(_kernel, f"{_name}_{_step}")


_LOW_WORD = wp.constant(wp.uint64(0xFFFFFFFF))
# Rows per thread of max_norm's packed search: on an H200 (float32, N = 10⁷, Segments) the
# kernel took 153 µs with 1 (an atomic per row), 58 with 3, 61 with 4 and 219 with 16
# (benchmarks/RESULTS.md).
PACKED_RUN = 3
_PACKED_RUN = wp.constant(PACKED_RUN)


@wp.func
def _packed_norm_key(x: wp.array3d(dtype=wp.float32), i: int, g: int):
    # (|x[i, g]|'s bits, NaN above all) << 32 | (2³² - 1 - i): the larger norm, then the first row
    norm = _norm(x, i, g)
    bits = _LOW_WORD
    if not _is_nan(norm):
        bits = wp.uint64(wp.cast(norm, wp.uint32))
    return (bits << wp.uint64(32)) | (_LOW_WORD - wp.uint64(i))


@_deferred
def _max_norm_packed_kernel(x: wp.array3d(dtype=wp.float32), idx: wp.array(dtype=wp.int32),
                            keys: wp.array3d(dtype=wp.uint32)):
    # keys (M, G, 2), zeros at first, becomes the (M, G) uint64 atomic max of the rows' packed
    # keys (0: an empty segment), in any order of the ids. A thread per run of _PACKED_RUN rows
    # and group keeps the best key of each run of one id, so that a segment of consecutive
    # rows takes few atomics.
    t, g = wp.tid()
    best = wp.array(ptr=keys.ptr, shape=(keys.shape[0], keys.shape[1]), dtype=wp.uint64)
    lo = t * _PACKED_RUN
    current = wp.int32(-1)
    top = wp.uint64(0)
    for i in range(lo, wp.min(lo + _PACKED_RUN, x.shape[0])):
        s = idx[i]
        if s != current:
            if current >= 0:
                wp.atomic_max(best, current, g, top)
            current = -1
            top = wp.uint64(0)
            if s >= 0 and s < keys.shape[0]:
                current = s
        if current >= 0:
            top = wp.max(top, _packed_norm_key(x, i, g))
    if current >= 0:
        wp.atomic_max(best, current, g, top)


_NEAR_FLOAT64 = 1.0 - 2.0 ** -50
_NEAR_FLOAT32 = 1.0 - 2.0 ** -21


@wp.func
def _near_below(square: wp.float64):
    # below any square whose root rounds to sqrt(square): 8 units in the last place below it
    return square * wp.float64(_NEAR_FLOAT64)


@wp.func
def _near_below(square: wp.float32):  # an overload per dtype
    return square * wp.float32(_NEAR_FLOAT32)


# max_norm's plain search on CPUs, in C ("float" stands for the dtype; PLAIN, NEAR and MAX for
# its PLAIN_SQUARES, _NEAR_FLOAT and largest value): rows lo:hi (lo < hi) of group g, eight at
# a time in vector lanes. Each lane keeps its largest square, the first row of it, and the
# largest before that row (take), so that no comparison waits on the one before and the
# segment is read once; `found` then gives the first row of the largest square if that
# square is plain and no row before it has a square a few units in the last place below
# it, -(row + 2) where one may, -1 where a square is NaN or the largest is not plain. Each
# square is the sum of the K products in order; rows of 3 features (G = 1) are loaded as 24
# entries (`rows8`, never past x's end) and sorted into the lanes by shuffles (`squares8`),
# every product before any sum (no multiply-add can fuse them); a lane past hi holds 0.
_SQUARES_LANES = _LANES8 + _ROWS8 + """
    const int k = x.shape[2];
    const int n = x.shape[0];
    const long long step = (long long)x.shape[1] * k;
    const float* rows = (const float*)x.data + (long long)g * k;
    lanes8 top = {-1, -1, -1, -1, -1, -1, -1, -1}, before = top;
    mask8 nan = {}, where = {};
    auto take = [&](int i, lanes8 square) {
        const mask8 taken = square > top;
        before = taken ? top : before;
        top = taken ? square : top;
        where = taken ? lane + i : where;
        nan |= square != square;
    };
    auto found = [&]() {
        const float best = __builtin_reduce_max(top);
        if (__builtin_reduce_or(nan) || !(best >= PLAIN && best <= MAX)) return -1;
        const int winner = __builtin_reduce_min(top == best ? where : hi);
        const float near = best * NEAR;
        const mask8 close = (before >= near) | ((top >= near) & (where < winner));
        return __builtin_reduce_or(close) ? -(winner + 2) : winner;
    };
    auto squares8 = [&](int rows_left, lanes8 a, lanes8 b, lanes8 c) {
        a = a * a;
        b = b * b;
        c = c * c;
        const lanes8 ab0 = __builtin_shufflevector(a, b, 0, 3, 6, 9, 12, 15, 0, 0);
        const lanes8 ab1 = __builtin_shufflevector(a, b, 1, 4, 7, 10, 13, 0, 0, 0);
        const lanes8 ab2 = __builtin_shufflevector(a, b, 2, 5, 8, 11, 14, 0, 0, 0);
        lanes8 square = {};
        square = square + __builtin_shufflevector(ab0, c, 0, 1, 2, 3, 4, 5, 10, 13);
        square = square + __builtin_shufflevector(ab1, c, 0, 1, 2, 3, 4, 8, 11, 14);
        square = square + __builtin_shufflevector(ab2, c, 0, 1, 2, 3, 4, 9, 12, 15);
        return lane < rows_left ? square : 0;
    };
"""

_PLAIN_SQUARES_SEARCH = _SQUARES_LANES + """
    if (k == 3 && step == 3) {  /* whole blocks of 8 rows, then the last, masked */
        auto block = [&](int i, int rows_left) {
            lanes8 a, b, c;
            rows8(rows, n, i, &a, &b, &c);
            take(i, squares8(rows_left, a, b, c));
        };
        int i = lo;
        for (; i + 8 <= hi; i += 8) block(i, 8);
        if (i < hi) block(i, hi - i);
        return found();
    }
    for (int i = lo; i < hi; i += 8) {
        lanes8 square = {};
        for (int j = 0; j < 8 && i + j < hi; j++) {
            const float* row = rows + (i + j) * step;
            for (int f = 0; f < k; f++) {
                const float term = row[f] * row[f];
                square[j] = square[j] + term;
            }
        }
        take(i, square);
    }
    return found();
"""


def _squares_search_source(dtype, source=_PLAIN_SQUARES_SEARCH, near=None):
    """`source` (_PLAIN_SQUARES_SEARCH) for `dtype` ("float32" or "float64"), its constants the
    kernels' own as exact C literals (NEAR `near`, by default _NEAR_FLOAT of the dtype)."""
    if near is None:
        near = _NEAR_FLOAT32 if dtype == "float32" else _NEAR_FLOAT64
    return _source_for(source, dtype, {"PLAIN": PLAIN_SQUARES[dtype], "NEAR": near,
                                       "MAX": float(np.finfo(dtype).max)})


@wp.func_native(_squares_search_source("float32"))
def _plain_squares_search(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int) -> int:
    ...


@wp.func_native(_squares_search_source("float64"))
def _plain_squares_search(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int) -> int:
    ...


def _largest_square_first(search, key, better):
    """max_norm's ordered search on CPUs: one pass in C by vector lanes
    (_plain_squares_search) finds the first row of the largest squared norm, and
    _squares_resolved(search, key) makes the answer of it. `better` is implied by the
    squares' order."""
    resolved = _squares_resolved(search, key)

    @wp.func
    def first_of_largest(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int):
        return resolved(x, lo, hi, g, _plain_squares_search(x, lo, hi, g))

    return first_of_largest


def _squares_resolved(search, key):
    """resolved(x, lo, hi, g, found): the first of rows lo:hi (lo < hi) of group g of the
    largest norm key(x, i, g), from `found`, _plain_squares_search's answer. Where the largest
    square is plain (so its root is the row's norm, the largest) and no row's is NaN, that is
    the first row whose norm equals it: the row found, unless a row before it may have a
    square a few units in the last place below (then its norm may round to the same; rows
    are then compared one by one). Otherwise `search` (the screened search) decides."""

    @wp.func
    def resolved(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int, found: int):
        if found >= 0:
            return found
        if found == -1:
            return search(x, lo, hi, g)
        winner = -found - 2  # a row before it may have the same norm: the first one
        best = _squared_norm(x, winner, g)
        near = _near_below(best)
        top = wp.sqrt(best)
        for i in range(lo, winner):
            if _squared_norm(x, i, g) >= near and key(x, i, g) == top:
                return i
        return winner

    return resolved


# The first of rows lo:hi (lo < hi) of entry g (of `groups`) attaining the largest value
# (`largest` 1, max) or the smallest (0, min), by one pass of branch-free comparisons, or -1
# where a value is NaN ("float" stands for the dtype; integers are never NaN)
_PLAIN_SEARCH = """
    const float* p = (const float*)x.data;
    float top = p[lo * groups + g];
    int winner = lo, nans = 0;
    for (int i = lo; i < hi; i++) {
        const float v = p[i * groups + g];
        const bool taken = largest ? v > top : v < top;
        top = taken ? v : top;
        winner = taken ? i : winner;
        nans += v != v;
    }
    return nans ? -1 : winner;
"""


@wp.func_native(_PLAIN_SEARCH)
def _plain_search(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_PLAIN_SEARCH.replace("float", "double"))
def _plain_search(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_PLAIN_SEARCH.replace("float", "wp::int32").replace("v != v", "0"))
def _plain_search(x: wp.array3d(dtype=wp.int32), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_PLAIN_SEARCH.replace("float", "wp::int64").replace("v != v", "0"))
def _plain_search(x: wp.array3d(dtype=wp.int64), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


def _first_by_plain_comparisons(largest):
    """max's (`largest` 1) and min's ordered search on CPUs: _plain_search finds the first row
    of the best key (3 times faster than the loop in Warp's language, benchmarks/RESULTS.md);
    where a key is NaN, `search` (which lets the first NaN win) decides."""

    def shortcut(search, key, better):
        @wp.func
        def first_of_best(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int):
            winner = _plain_search(x, lo, hi, g, x.shape[1], largest)
            if winner < 0:
                return search(x, lo, hi, g)
            return winner

        return first_of_best

    return shortcut


# The first rows of rows lo:hi (lo < hi) of x (N, 3, 1) attaining each entry's largest value
# (`largest` 1, max) or smallest (0, min), 8 rows at a time in vector lanes: their 24 entries
# (`rows8`) sorted by shuffles into a vector per entry, each lane keeping its best value and
# the first row of it, starting from row lo's, so that no comparison waits on another; the
# lanes then give each entry's best value and its first row, or -1 where the entry has a NaN
# ("float" stands for the dtype).
_PLAIN_SEARCH3 = _LANES8 + _ROWS8 + """
    const float* rows = (const float*)x.data;
    lanes8 top[3];
    mask8 where[3], nan[3] = {};
    for (int c = 0; c < 3; c++) {
        top[c] = lanes8{} + rows[3LL * lo + c];
        where[c] = mask8{} + lo;
    }
    for (int i = lo; i < hi; i += 8) {
        lanes8 a, b, c;
        rows8(rows, x.shape[0], i, &a, &b, &c);
        const lanes8 ab0 = __builtin_shufflevector(a, b, 0, 3, 6, 9, 12, 15, 0, 0);
        const lanes8 ab1 = __builtin_shufflevector(a, b, 1, 4, 7, 10, 13, 0, 0, 0);
        const lanes8 ab2 = __builtin_shufflevector(a, b, 2, 5, 8, 11, 14, 0, 0, 0);
        const lanes8 v[3] = {__builtin_shufflevector(ab0, c, 0, 1, 2, 3, 4, 5, 10, 13),
                             __builtin_shufflevector(ab1, c, 0, 1, 2, 3, 4, 8, 11, 14),
                             __builtin_shufflevector(ab2, c, 0, 1, 2, 3, 4, 9, 12, 15)};
        const mask8 inside = lane < hi - i;
        for (int e = 0; e < 3; e++) {
            const mask8 taken = inside & (largest ? v[e] > top[e] : v[e] < top[e]);
            top[e] = taken ? v[e] : top[e];
            where[e] = taken ? lane + i : where[e];
            nan[e] |= inside & (v[e] != v[e]);
        }
    }
    int first[3];
    for (int e = 0; e < 3; e++) {
        const float best = largest ? __builtin_reduce_max(top[e]) : __builtin_reduce_min(top[e]);
        const int winner = __builtin_reduce_min(top[e] == best ? where[e] : hi);
        first[e] = __builtin_reduce_or(nan[e]) ? -1 : winner;
    }
    return wp::vec_t<3, wp::int32>(first[0], first[1], first[2]);
"""


def _plain_search3_source(dtype):
    """_PLAIN_SEARCH3 for `dtype` (a C type)."""
    return _PLAIN_SEARCH3.replace("float", dtype)


@wp.func_native(_plain_search3_source("float"))
def _plain_search3(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_plain_search3_source("double"))
def _plain_search3(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_plain_search3_source("wp::int32"))
def _plain_search3(x: wp.array3d(dtype=wp.int32), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_plain_search3_source("wp::int64"))
def _plain_search3(x: wp.array3d(dtype=wp.int64), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


def _cpu_ordered_extreme(largest, key, better):
    """max's (`largest` 1) or min's ordered search on CPUs, a thread per segment over all its
    entries: where the ids are ordered, out[s, g] for every entry g of segment s (N if it is
    empty), else left as given. Rows of 3 entries (x (N, 3, 1)) are searched together by
    _plain_search3 (3 times faster than an entry at a time, benchmarks/RESULTS.md), an entry
    with a NaN (which must win where it first comes) then alone; other shapes an entry at a
    time by _first_by_plain_comparisons."""
    search = _first_by_plain_comparisons(largest)(_ordered_search(key, better), key, better)

    def kernel(x: wp.array3d(dtype=Any), offsets: wp.array(dtype=wp.int32),
               ordered: wp.array(dtype=wp.int32), out: wp.array2d(dtype=wp.int32)):
        s = wp.tid()
        if ordered[0] == 0:
            return
        lo, hi = _segment_range(offsets, s, x.shape[0])
        entries = out.shape[1]
        if lo == hi:
            for g in range(entries):
                out[s, g] = x.shape[0]
        elif entries == 3 and x.shape[2] == 1:
            found = _plain_search3(x, lo, hi, largest)
            for g in range(3):
                first = found[g]
                if first < 0:
                    first = search(x, lo, hi, g)
                out[s, g] = first
        else:
            for g in range(entries):
                out[s, g] = search(x, lo, hi, g)

    return kernel


# The ordered searches on CPUs: plain comparisons first (1.5–2× faster there). GPUs keep the
# searches above for max and min (the shortcuts not measured there) and take max_norm's by
# lanes (max_norm_lanes, below; benchmarks/RESULTS.md).
_deferred(_extreme(_norm, _above, _atomic_above, screen=_squared_norm,
                   shortcut=_largest_square_first)[0], "max_norm_cpu_ordered")
_deferred(_cpu_ordered_extreme(1, _value, _above), "max_cpu_ordered")
_deferred(_cpu_ordered_extreme(0, _value, _below), "min_cpu_ordered")


# max_norm's ordered search on GPUs by a group of `lanes` threads a segment ("float" stands for
# the dtype; PLAIN, NEAR and MAX its constants): lane j takes rows lo + j, lo + j + lanes, ...
# of group g (rows of 3 alone, 16-byte aligned: the blocks j, j + lanes, ... of `per` rows, 48
# bytes loaded as three 16-byte vectors; on an H100 float64's forward 149–158 → 110–114 µs at
# N = 10⁷, benchmarks/RESULTS.md), keeping its largest squared norm (`top`, at row `where`) and
# the largest of its other rows (`runner`), each row's square summed in the order of its
# entries; the lanes then join by butterflies. The answer is the first row of
# the largest square where that square is plain (PLAIN·4 to MAX/4) and no square is NaN or
# within NEAR of it on another row (there norms may tie or, the squares summed by multiply-adds
# unlike the key's, change order); otherwise -1, for the one-thread search to decide.
_LANES_SQUARES_SEARCH = """
    const int k = x.shape[2];
    const long long step = (long long)x.shape[1] * k;
    const float* rows = (const float*)x.data + (long long)g * k;
    float top = -1, runner = -1;
    int where = hi, nan = 0;
    auto consider = [&](int i, float square) {
        nan |= square != square;
        if (square > top) {
            runner = top;
            top = square;
            where = i;
        } else if (square > runner) {
            runner = square;
        }
    };
#if defined(__CUDA_ARCH__)
    constexpr int per = 16 / sizeof(float);
    struct alignas(16) quad { float e[per]; };
    if (k == 3 && step == 3 && ((unsigned long long)x.data & 15) == 0) {
        const quad* blocks = (const quad*)x.data;
        const long long entries = 3LL * x.shape[0];
        for (int b = lo / per + lane; b * per < hi; b += lanes) {
            const long long first = 3LL * per * b;
            float v[3 * per];
            if (first + 3 * per <= entries) {
                for (int j = 0; j < 3; j++) {
                    const quad q = blocks[3LL * b + j];
                    for (int t = 0; t < per; t++) v[j * per + t] = q.e[t];
                }
            } else {  /* the array's last rows: nothing read past its end */
                for (int e = 0; e < 3 * per; e++) v[e] = first + e < entries ? rows[first + e] : 0;
            }
            for (int t = 0; t < per; t++) {
                const int i = b * per + t;
                const float* r = v + 3 * t;
                if (i >= lo && i < hi)
                    consider(i, fma(r[2], r[2], fma(r[1], r[1], fma(r[0], r[0], (float)0))));
            }
        }
    } else
#endif
    for (int i = lo + lane; i < hi; i += lanes) {
        const float* row = rows + i * step;
        float square = 0;
        for (int f = 0; f < k; f++) {
#if defined(__CUDA_ARCH__)
            square = fma(row[f], row[f], square);
#else
            square = square + row[f] * row[f];
#endif
        }
        consider(i, square);
    }
    float best = top;
#if defined(__CUDA_ARCH__)
    const unsigned int base = (threadIdx.x & 31u) & ~(unsigned int)(lanes - 1);
    const unsigned int mask = lanes >= 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u) << base;
    for (int o = lanes / 2; o > 0; o /= 2) {
        const float other = __shfl_xor_sync(mask, best, o, lanes);
        best = other > best ? other : best;
        nan |= __shfl_xor_sync(mask, nan, o, lanes);
    }
#endif
    int winner = top == best ? where : hi;
#if defined(__CUDA_ARCH__)
    for (int o = lanes / 2; o > 0; o /= 2) {
        const int other = __shfl_xor_sync(mask, winner, o, lanes);
        winner = other < winner ? other : winner;
    }
#endif
    const float near = best * NEAR;
    int close = runner >= near || (top >= near && where != winner);
#if defined(__CUDA_ARCH__)
    for (int o = lanes / 2; o > 0; o /= 2) close |= __shfl_xor_sync(mask, close, o, lanes);
#endif
    const bool plain = best >= PLAIN * 4 && best <= MAX / 4;
    return nan || close || !plain ? -1 : winner;
"""


def _lanes_squares_source(dtype):
    """_LANES_SQUARES_SEARCH for `dtype`: its window 2⁻¹⁷ (float32) or 2⁻⁴⁴ (float64) wide."""
    near = 1.0 - 2.0 ** (-17 if dtype == "float32" else -44)
    return _squares_search_source(dtype, _LANES_SQUARES_SEARCH, near)


@wp.func_native(_lanes_squares_source("float32"))
def _lanes_squares_search(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int, lane: int,
                          lanes: int) -> int:
    """The first row of lo:hi (lo < hi) of the largest |x[i, g]|, where plain squares decide it
    beyond doubt; else -1 (the same in every lane of the group)."""
    ...


@wp.func_native(_lanes_squares_source("float64"))
def _lanes_squares_search(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int, lane: int,
                          lanes: int) -> int:
    ...


# the one-thread search where the lanes' squares do not decide: a row at a time, whose fewer
# registers let more warps run (ncu on an H100: 40 registers a thread against 48 with rows
# taken 4 at a time, 64 % of the warps active against 53 %, the kernel 119–122 µs against
# 130–133)
_max_norm_search = _ordered_search(_norm, _above, unroll=False)


@_deferred
def _max_norm_lanes_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    ordered: wp.array(dtype=wp.int32),
    lanes: int,
    norms: wp.array2d(dtype=Any),
    out: wp.array2d(dtype=wp.int32),
):
    # max_norm's ordered search on GPUs, a group of lanes a segment and group, launched
    # (M·G·lanes,): where the ids are ordered, out[s, g] becomes the first row of the largest norm
    # of the segment (_lanes_squares_search, else the one-thread search), N for an empty one,
    # and norms[s, g] (unless norms has no rows) that row's norm, 0 for an empty one; both
    # left as given otherwise.
    t, lane = _lane_split(wp.tid(), lanes)
    lanes = _lanes_here(lanes)
    if lane >= lanes or ordered[0] == 0:
        return
    s, g, lo, hi = _group_of(offsets, t, out.shape[1], x.shape[0])
    if lo < hi:
        found = _lanes_squares_search(x, lo, hi, g, lane, lanes)
        if lane == 0:
            if found < 0:
                found = _max_norm_search(x, lo, hi, g)
            out[s, g] = found
            if norms.shape[0] > 0:
                norms[s, g] = _norm(x, found, g)
    elif lane == 0:
        out[s, g] = x.shape[0]
        if norms.shape[0] > 0:
            norms[s, g] = x.dtype(0.0)


REDUCE_BITS = {"sum": 1, "mean": 2, "rms_norm": 4, "max_norm": 8}
"""Each reduction's bit in reductions3's `want`."""
_WANT_RMS = wp.constant(REDUCE_BITS["rms_norm"])
_WANT_LARGEST = wp.constant(REDUCE_BITS["max_norm"])

# Several reductions of the rows lo:hi of x (N, 1, 3) by one thread, each block of 8 rows
# (24 entries) read once for all those `want` asks (the bits of REDUCE_BITS):
# the sum and the mean into sums[s] and means[s] as _ROWS3_SUM gives them, Σ|x|² into rms[s]
# as _SPAN_SUM adds it (one lane, factor 1), max_norm's search as _PLAIN_SQUARES_SEARCH (its
# answer returned, else 0) and, where it found the row, that row's norm into largest[s]:
# every bit as those give it. CPUs only.
_REDUCTIONS3 = _SQUARES_LANES + _SUM3_MEAN3 + """
    const bool sum = want & {sum}, mean = want & {mean}, rms = want & {rms_norm};
    const bool largest = want & {max_norm};
""".format(**REDUCE_BITS) + """
    const float f = 1;
    lanes8 plain[3] = {}, squares = {};
    auto block = [&](int i, int rows_left) {  /* whole blocks unmasked once inlined */
        lanes8 v[3];
        rows8(rows, n, i, &v[0], &v[1], &v[2]);
        for (int k = 0; k < 3; k++) {
            const mask8 inside = lane + 8 * k < 3 * rows_left;
            if (sum || mean) plain[k] = inside ? plain[k] + v[k] * f : plain[k];
            if (rms) squares = inside ? squares + v[k] * f * v[k] : squares;
        }
        if (largest) take(i, squares8(rows_left, v[0], v[1], v[2]));
    };
    int i = lo;
    for (; i + 8 <= hi; i += 8) block(i, 8);
    if (i < hi) block(i, hi - i);
    const wp::vec_t<3, float> total(sum24(plain, 0), sum24(plain, 1), sum24(plain, 2));
    const wp::vec_t<3, float> average = mean ? mean3(total) : total;
    for (int d = 0; d < 3 && sum; d++) ((float*)sums.data)[3LL * s + d] = total[d];
    for (int d = 0; d < 3 && mean; d++) ((float*)means.data)[3LL * s + d] = average[d];
    if (rms) ((float*)rms_out.data)[s] = sum8(squares);
    if (!largest) return 0;
    const int winner = found();  /* its norm the root of its plain square, as _norm takes it */
    if (winner >= 0) ((float*)largest_out.data)[s] = wp::sqrt(__builtin_reduce_max(top));
    return winner;
"""


@wp.func_native(_squares_search_source("float32", _REDUCTIONS3))
def _reductions3(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int, s: int, want: int,
                 sums: wp.array2d(dtype=wp.vec3f), means: wp.array2d(dtype=wp.vec3f),
                 rms_out: wp.array2d(dtype=wp.float32),
                 largest_out: wp.array2d(dtype=wp.float32)) -> int:
    ...


@wp.func_native(_squares_search_source("float64", _REDUCTIONS3))
def _reductions3(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int, s: int, want: int,
                 sums: wp.array2d(dtype=wp.vec3d), means: wp.array2d(dtype=wp.vec3d),
                 rms_out: wp.array2d(dtype=wp.float64),
                 largest_out: wp.array2d(dtype=wp.float64)) -> int:
    ...


_first_of_largest_norm = _squares_resolved(_ordered_search(_norm, _above, _squared_norm), _norm)


@_deferred
def _reductions3_kernel(
    x: wp.array3d(dtype=Any),
    offsets: wp.array(dtype=wp.int32),
    want: int,
    sums: wp.array2d(dtype=Any),
    means: wp.array2d(dtype=Any),
    rms: wp.array2d(dtype=Any),
    largest: wp.array2d(dtype=Any),
):
    # a thread per segment s: the reductions `want` asks of its rows (see _REDUCTIONS3), rms
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


@_deferred
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


@_deferred
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


@_deferred
def _gather_kernel(y: wp.array2d(dtype=Any), idx: wp.array(dtype=wp.int32),
                   out: wp.array2d(dtype=Any)):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < y.shape[0]
    for k in range(out.shape[1]):
        if valid:
            out[i, k] = y[s, k]
        else:
            out[i, k] = out.dtype(0.0)


@_deferred
def _put_kernel(ct: wp.array3d(dtype=Any), first: wp.array2d(dtype=wp.int32),
                idx: wp.array(dtype=wp.int32), out: wp.array3d(dtype=Any)):
    # out[i, g] = ct[s, g] where row i is the one first[s, g] chose (s = idx[i], the only
    # segment that can have), else 0: each row written once
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < ct.shape[0]
    for g in range(out.shape[1]):
        chosen = False
        if valid:
            chosen = first[s, g] == i
        for k in range(out.shape[2]):
            v = out.dtype(0.0)
            if chosen:  # (ct read only then: s may be out of range)
                v = ct[s, g, k]
            out[i, g, k] = v


@_deferred
def _put3_kernel(ct: wp.array(dtype=Any), first: wp.array2d(dtype=wp.int32),
                 idx: wp.array(dtype=wp.int32), out: wp.array(dtype=Any)):
    # put for rows of 3 entries, whole vectors, a thread a row: entry f of out[i] = ct[s][f]
    # where row i is the one chosen for it (s = idx[i]): first[s, 0] = i for one group of 3
    # features (first (M, 1)), first[s, f] = i for 3 groups of one (first (M, 3)); else 0
    i = wp.tid()
    s = idx[i]
    v = type(out[i])()
    if s >= 0 and s < ct.shape[0]:
        c = ct[s]
        last = first.shape[1] - 1  # 0 or 2
        if first[s, 0] == i:
            v[0] = c[0]
        if first[s, wp.min(1, last)] == i:
            v[1] = c[1]
        if first[s, last] == i:
            v[2] = c[2]
    out[i] = v


def _segment_factors(paired):
    """(y[s, g], z[s, g] or 1 where z has no rows, w[s, g] if `paired`): the factors of the
    scale kernels for segment s, (0, 1, 0) where s is out of range."""

    @wp.func
    def factors(y: wp.array2d(dtype=Any), z: wp.array2d(dtype=Any), w: wp.array2d(dtype=Any),
                s: int, g: int):
        factor = y.dtype(0.0)
        second = y.dtype(1.0)
        third = y.dtype(0.0)
        if s >= 0 and s < y.shape[0]:
            factor = y[s, g]
            if z.shape[0] > 0:
                second = z[s, g]
            if wp.static(paired):
                third = w[s, g]
        return factor, second, third

    return factors


def _scaling(paired):
    """The scale kernel: x times a factor of its segment, then by a second where z has rows
    (two factors whose product alone would underflow: a power of two near 1/|x| times a small
    cotangent); `paired`, plus b times the first factor and w (rescale2)."""
    factors = _segment_factors(paired)

    def kernel(
        x: wp.array3d(dtype=Any),
        y: wp.array2d(dtype=Any),
        z: wp.array2d(dtype=Any),
        b: wp.array3d(dtype=Any),
        w: wp.array2d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        out: wp.array3d(dtype=Any),
    ):
        i = wp.tid()
        for g in range(x.shape[1]):
            factor, second, third = factors(y, z, w, idx[i], g)
            for k in range(x.shape[2]):
                v = x[i, g, k] * factor * second
                if wp.static(paired):
                    v += b[i, g, k] * factor * third
                out[i, g, k] = v

    return kernel


_deferred(_scaling(False), "scale")
_deferred(_scaling(True), "scale_pair")


@_deferred
def _matvec_kernel(
    v: wp.array3d(dtype=Any),
    m: wp.array4d(dtype=Any),
    idx: wp.array(dtype=wp.int32),
    transpose: int,
    out: wp.array3d(dtype=Any),
):
    i = wp.tid()
    s = idx[i]
    valid = s >= 0 and s < m.shape[0]
    for g in range(v.shape[1]):
        for j in range(out.shape[2]):
            acc = out.dtype(0.0)
            if valid:
                for k in range(v.shape[2]):
                    if transpose != 0:
                        acc += v[i, g, k] * m[s, g, j, k]
                    else:
                        acc += v[i, g, k] * m[s, g, k, j]
            out[i, g, j] = acc


# The common case of one group of 3 features, with whole vectors and matrices per thread.



# The ordered scale kernels' rows lo:hi of a segment on CPUs: out[i] = x[i] · factor · second,
# plus (b[i] · factor) · third where `paired`, over the 3 entries of each row, one operation a
# statement as the row-a-thread kernels compute them (so that no multiply-add fuses two and
# every bit is the same), in a loop the compiler vectorises ("float" stands for the dtype)
_SCALE_ROWS = """
    const float* xs = (const float*)x.data;
    const float* bs = (const float*)b.data;
    float* outs = (float*)out.data;
    const long long first = 3LL * lo, last = 3LL * hi;
    if (paired) {
        for (long long i = first; i < last; i++) {
            const float scaled = xs[i] * factor;
            const float v = scaled * second;
            const float scaled_b = bs[i] * factor;
            const float u = scaled_b * third;
            outs[i] = v + u;
        }
    } else {
        for (long long i = first; i < last; i++) {
            const float scaled = xs[i] * factor;
            outs[i] = scaled * second;
        }
    }
"""


@wp.func_native(_SCALE_ROWS)
def _scale_rows(x: wp.array(dtype=wp.vec3f), b: wp.array(dtype=wp.vec3f),
                out: wp.array(dtype=wp.vec3f), lo: int, hi: int, factor: wp.float32,
                second: wp.float32, third: wp.float32, paired: int):
    ...


@wp.func_native(_SCALE_ROWS.replace("float", "double"))
def _scale_rows(x: wp.array(dtype=wp.vec3d), b: wp.array(dtype=wp.vec3d),
                out: wp.array(dtype=wp.vec3d), lo: int, hi: int, factor: wp.float64,
                second: wp.float64, third: wp.float64, paired: int):
    ...


# The rows lo:hi of out, a (N,) vec3 array as 3N entries, set to (a, b, c) on CPUs: in a loop
# the compiler vectorises ("float" stands for the dtype)
_FILL_ROWS = """
    float* outs = (float*)out.data;
    for (long long i = 3LL * lo; i < 3LL * hi; i += 3) {
        outs[i] = a;
        outs[i + 1] = b;
        outs[i + 2] = c;
    }
"""


@wp.func_native(_FILL_ROWS)
def _fill_rows(out: wp.array(dtype=wp.vec3f), lo: int, hi: int, a: wp.float32, b: wp.float32,
               c: wp.float32):
    ...


@wp.func_native(_FILL_ROWS.replace("float", "double"))
def _fill_rows(out: wp.array(dtype=wp.vec3d), lo: int, hi: int, a: wp.float64, b: wp.float64,
               c: wp.float64):
    ...


@wp.func
def _ordered_rows(offsets: wp.array(dtype=wp.int32), t: int, out: wp.array(dtype=Any)):
    # rows lo:hi of segment t of out (N,), after zeroing the rows outside every segment
    # (ahead of the first, after the last) where t is the first or the last segment
    n = out.shape[0]
    lo, hi = _segment_range(offsets, t, n)
    if t == 0:
        for i in range(0, lo):
            out[i] = type(out[i])()
    if t == offsets.shape[0] - 2:
        for i in range(hi, n):
            out[i] = type(out[i])()
    return lo, hi


def _gathering3(ordered):
    """out[i] = y[idx[i]] (0 where the id is out of range) for rows of 3: a row a thread, or
    where `ordered` (CPUs, the segments' offsets given) a segment a thread filling its rows."""

    def kernel(y: wp.array(dtype=Any), idx: wp.array(dtype=wp.int32),
               offsets: wp.array(dtype=wp.int32), out: wp.array(dtype=Any)):
        t = wp.tid()
        if wp.static(ordered):
            lo, hi = _ordered_rows(offsets, t, out)
            v = y[t]
            _fill_rows(out, lo, hi, v[0], v[1], v[2])
        else:
            s = idx[t]
            if s >= 0 and s < y.shape[0]:
                out[t] = y[s]
            else:
                out[t] = type(out[t])()

    return kernel


for _ordered in (False, True):
    _deferred(_gathering3(_ordered), "gather3" + "_ordered" * _ordered)


def _scaling3(paired, ordered):
    """_scaling for rows of one group of 3 features, whole vectors: a row a thread, or where
    `ordered` (CPUs, the segments' offsets given) a segment a thread, its factors found once
    for its rows, and the rows outside every segment (ahead of the first, after the last) 0."""
    factors = _segment_factors(paired)

    def kernel(
        x: wp.array(dtype=Any),
        y: wp.array2d(dtype=Any),
        z: wp.array2d(dtype=Any),
        b: wp.array(dtype=Any),
        w: wp.array2d(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        offsets: wp.array(dtype=wp.int32),
        out: wp.array(dtype=Any),
    ):
        t = wp.tid()
        if wp.static(ordered):
            lo, hi = _ordered_rows(offsets, t, out)
            factor, second, third = factors(y, z, w, t, 0)
            _scale_rows(x, b, out, lo, hi, factor, second, third, wp.static(int(paired)))
        else:
            factor, second, third = factors(y, z, w, idx[t], 0)
            v = x[t] * factor * second
            if wp.static(paired):
                v += b[t] * factor * third
            out[t] = v

    return kernel


for _ordered in (False, True):
    _deferred(_scaling3(False, _ordered), "scale3" + "_ordered" * _ordered)
    _deferred(_scaling3(True, _ordered), "scale_pair3" + "_ordered" * _ordered)


def _matvec3(ordered):
    """matvec for rows of 3: a row a thread, or where `ordered` (CPUs, the segments' offsets
    given) a segment a thread, its matrix read once for its rows."""

    def kernel(
        v: wp.array(dtype=Any),
        m: wp.array(dtype=Any),
        idx: wp.array(dtype=wp.int32),
        offsets: wp.array(dtype=wp.int32),
        transpose: int,
        out: wp.array(dtype=Any),
    ):
        t = wp.tid()
        if wp.static(ordered):
            lo, hi = _ordered_rows(offsets, t, out)
            a = m[t]
            if transpose == 0:
                a = wp.transpose(a)
            for i in range(lo, hi):
                out[i] = a @ v[i]
        else:
            s = idx[t]
            if s >= 0 and s < m.shape[0]:
                if transpose != 0:
                    out[t] = m[s] @ v[t]
                else:
                    out[t] = wp.transpose(m[s]) @ v[t]
            else:
                out[t] = type(out[t])()

    return kernel


for _ordered in (False, True):
    _deferred(_matvec3(_ordered), "matvec3" + "_ordered" * _ordered)


# Neighbour pairs in periodic cells, from a cell list (segcli.neighbors builds the bins).


@wp.func
def _image(t: int, bins: int, periodic: int):
    # Bin t of an axis of `bins` bins, as (the bin it is, the periodic image it lies in, whether
    # it exists): periodic axes wrap, the others end.
    if periodic != 0:
        # the floor of t / bins, dividing non-negative integers only (so whatever the sign
        # convention of integer division)
        image = t / bins
        if t < 0:
            image = -((-t - 1) / bins) - 1
        return t - image * bins, image, True
    return t, 0, t >= 0 and t < bins


@_deferred
def _neighbors_kernel(
    positions: wp.array(dtype=wp.vec3d),
    row: wp.array(dtype=wp.int32),
    structure: wp.array(dtype=wp.int32),
    bin_xyz: wp.array(dtype=wp.vec3i),
    bin_start: wp.array(dtype=wp.int32),
    lattice: wp.array(dtype=wp.mat33d),
    bins: wp.array(dtype=wp.vec3i),
    reach: wp.array(dtype=wp.vec3i),
    periodic: wp.array(dtype=wp.vec3i),
    first_bin: wp.array(dtype=wp.int32),
    first_row: wp.array(dtype=wp.int32),
    cutoffs: wp.array(dtype=wp.float64),
    histogram_scale: wp.array(dtype=wp.float64),
    counts: wp.array2d(dtype=wp.int64),
    nearest: wp.array(dtype=wp.float64),
    partner: wp.array(dtype=wp.int32),
    histogram: wp.array(dtype=wp.int32),
):
    # One thread per atom p (in bin order): every atom q of the bins within `reach` of its own,
    # in each periodic image those bins lie in, counted per cutoff (distance < cutoff, the atom
    # itself only in other images), the nearest kept (the lowest index on a tie) and, with a
    # histogram, each distance's bin counted. Results go to the atom's row of the chunk.
    p = wp.tid()
    s = structure[p]
    if s < 0:
        return
    i = row[p]
    xi = positions[p]
    b = bin_xyz[p]
    n = bins[s]
    r = reach[s]
    wrap = periodic[s]
    cell = lattice[s]
    top = cutoffs[cutoffs.shape[0] - 1]
    best = wp.float64(wp.inf)
    best_j = int(-1)  # noqa: UP018, RUF046  (a Warp variable, not a constant: it changes)
    for d0 in range(-r[0], r[0] + 1):
        w0, n0, ok0 = _image(b[0] + d0, n[0], wrap[0])
        if not ok0:
            continue
        for d1 in range(-r[1], r[1] + 1):
            w1, n1, ok1 = _image(b[1] + d1, n[1], wrap[1])
            if not ok1:
                continue
            for d2 in range(-r[2], r[2] + 1):
                w2, n2, ok2 = _image(b[2] + d2, n[2], wrap[2])
                if not ok2:
                    continue
                shift = (wp.float64(n0) * cell[0] + wp.float64(n1) * cell[1]
                         + wp.float64(n2) * cell[2])
                same = n0 == 0 and n1 == 0 and n2 == 0
                k = first_bin[s] + (w0 * n[1] + w1) * n[2] + w2
                for q in range(bin_start[k], bin_start[k + 1]):
                    if same and q == p:
                        continue
                    # (x_j - x_i) + shift is exactly minus the pair j, i: ties are exact
                    v = (positions[q] - xi) + shift
                    distance = wp.length(v)
                    if distance < wp.float64(1e-150):  # its square may have underflowed
                        scale = wp.max(wp.max(wp.abs(v[0]), wp.abs(v[1])), wp.abs(v[2]))
                        if scale > wp.float64(0.0):
                            distance = scale * wp.length(v / scale)
                    if distance < top:
                        for c in range(cutoffs.shape[0]):
                            if distance < cutoffs[c]:
                                counts[i, c] = counts[i, c] + wp.int64(1)
                        j = row[q] - first_row[s]
                        if distance < best or (distance == best and j < best_j):
                            best = distance
                            best_j = j
                        if histogram_scale[0] > wp.float64(0.0):
                            h = wp.min(int(distance * histogram_scale[0]), histogram.shape[0] - 1)
                            wp.atomic_add(histogram, h, 1)
    nearest[i] = best
    partner[i] = best_j


# Element types of the generic kernels' arguments that are not plain arrays of the kernel's
# dtype T ("scalar"), and the dtypes T each kernel is made for (default: the float types).
_ELEMENTS = {
    "count": {"a": "int32", "b": "int32", "out": "int32"},
    "sum3": {"a": "vec3", "b": "vec3", "out": "vec3"},
    "mean3": {"a": "vec3", "b": "vec3", "out": "vec3"},
    "reductions3": {"sums": "vec3", "means": "vec3"},
    **{name: {"y": "vec3", "out": "vec3"} for name in ("gather3", "gather3_ordered")},
    "put3": {"ct": "vec3", "out": "vec3"},
    **{name: {"x": "vec3", "b": "vec3", "out": "vec3"}
       for name in ("scale3", "scale_pair3", "scale3_ordered", "scale_pair3_ordered")},
    **{name: {"v": "vec3", "m": "mat33", "out": "vec3"} for name in ("matvec3", "matvec3_ordered")},
}
_INTEGERS = {"int32": wp.int32, "int64": wp.int64}
_DTYPES = {
    "count": {"int32": wp.int32},
    "wide_squares": {"float32": wp.float32},
    "rms_norm_of_wide_squares": {"float32": wp.float32},
    "max_norm_packed": {"float32": wp.float32},
    "neighbors": {"float64": wp.float64},
    "put3": {"float64": wp.float64},
    **dict.fromkeys(("bincount", "bincount_atomic"), _INTEGERS),
    **{name: {**_FLOATS, **_INTEGERS}
       for name in ("sum", "max_ordered", "max_cpu_ordered", "max_best", "max_first",
                    "min_ordered", "min_cpu_ordered", "min_best", "min_first")},
}


def _overload(name, kernel, dtype):
    element = {"scalar": dtype, "int32": wp.int32, "vec3": wp.types.vector(3, dtype),
               "mat33": wp.types.matrix((3, 3), dtype)}
    kinds = _ELEMENTS.get(name, {})
    concrete = {
        a.label: wp.array(dtype=element[kinds.get(a.label, "scalar")], ndim=a.type.ndim)
        for a in kernel.adj.args
        if getattr(a.type, "dtype", None) is Any
    }
    return wp.overload(kernel, concrete)


# Warp's options of a kernel beside its source. max_norm_lanes at most 40 registers a thread
# (12 blocks of 128 an SM) where it took 48 (10 blocks): on an H100, flat launches, float64
# 113 → 105 µs at N = 10⁷, float32 as fast (benchmarks/RESULTS.md).
_KERNEL_OPTIONS = {"max_norm_lanes": {"launch_bounds": (_BLOCK_DIM, 12)}}

_MADE = {}  # kernel name -> {dtype name: Warp kernel}, the kernels made so far
_MAKING = threading.Lock()


def _kernels(name):
    """Kernel `name` as {dtype name: Warp kernel}, made on its first launch (once, whatever
    the threads) in a Warp module of its own, with the overloads of all its dtypes if
    generic (so that its module compiles once, into Warp's kernel cache, not once per overload
    seen) and without the adjoint code Warp would generate for its own autodiff (JAX
    differentiates the primitives): a process hashes, loads and compiles only the kernels its
    ops launch."""
    with _MAKING:
        if name not in _MADE:
            kernel = wp.kernel(_SOURCES[name], enable_backward=False, module=f"segcli_{name}",
                               **_KERNEL_OPTIONS.get(name, {}))
            dtypes = _DTYPES.get(name, _FLOATS)
            _MADE[name] = (dict.fromkeys(dtypes, kernel) if not kernel.is_generic else
                           {dtype: _overload(name, kernel, t) for dtype, t in dtypes.items()})
        return _MADE[name]


@functools.cache
def _ffi(name, dtype, in_out, pure):
    kernel = _kernels(name)[dtype]
    outputs = len(in_out) + sum(1 for a in kernel.adj.args
                                if a.label in pure and a.label not in in_out)
    return wp.jax_kernel(kernel, num_outputs=outputs, in_out_argnames=list(in_out),
                         vmap_method="sequential", block_dim=_BLOCK_DIM)


def launch(name, *args, dims, in_out=(), out=None, dtype=None):
    """Launch kernel `name` over `dims` threads from JAX; returns its outputs (a list if several).

    `dtype` picks the overload (default: the first float argument's dtype, else the kernel's
    only one).
    The in-out arguments are updated copies of the arrays passed for them; `out`, if given,
    is the shape of a pure output named "out", or {name: shape} of pure outputs (the kernel's
    last arguments). One FFI call is one kernel launch, so JAX can capture it into its own
    CUDA graph."""
    if dtype is None:
        floats = [a for a in args if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
        dtype = (jnp.dtype(floats[0].dtype).name if floats
                 else next(iter(_DTYPES.get(name, _FLOATS))))
    if _native.available():
        result = _native.launch(_kernels(name)[jnp.dtype(dtype).name], args, dims, in_out, out,
                                _BLOCK_DIM)
    else:
        shapes = out if isinstance(out, dict) else {"out": out}
        call = _ffi(name, jnp.dtype(dtype).name, tuple(in_out), tuple(shapes))
        result = call(*args, launch_dims=dims,
                      output_dims={k: v for k, v in shapes.items() if v is not None} or None)
    return result[0] if len(result) == 1 else result


def stride(gpu, n):
    """Threads of the unordered fallback's grid-stride loop: one on a CPU, many on a GPU."""
    return max(1, min(n, _GPU_STRIDE_THREADS)) if gpu else 1
