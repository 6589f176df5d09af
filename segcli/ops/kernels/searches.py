"""Search kernels: the first row attaining each segment's extreme (max, min, max_norm).

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

The searches come from one factory (`_extreme`) over the key they compare; max and min are
made for int32 and int64 as well as the float types.
"""

from typing import Any

import numpy as np
import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import (
    _atomic_above,
    _atomic_below,
    _group_of,
    _lane_split,
    _lanes_here,
    _segment_range,
)
from segcli.ops.kernels._registry import ANY, BLOCK_DIM, FLOATS, INTEGERS, kernel, variants
from segcli.ops.kernels.norms import PLAIN_SQUARES, _norm, _plain_square, _squared_norm

# Rows whose keys the ordered search for an extreme computes together, ahead of comparing
# them in order, so that a thread walking its segment keeps several rows in flight (max_norm's
# one-thread search on an H200, before max_norm_lanes: 215 → 167 µs at N = 10⁷; the same for
# sum and rms_norm bought nothing).
_UNROLL = 4

# Lanes of max_norm's search (max_norm_lanes) by dtype: a group takes 16 rows of 3 a pass (its
# lanes' blocks of 4 float32 rows or 2 float64 rows). On an H100 at N = 10⁷, float32 by 4
# lanes 70.6–71.7 µs against 77.8–84.1 by 8; float64 by 8 lanes 111.5 µs against 119.3 by 4
# (benchmarks/RESULTS.md).
MAX_NORM_LANES = {"float32": 4, "float64": 8}


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


def _squares_constants(dtype, near=None):
    """The constants of the squares searches' C for `dtype`: PLAIN_SQUARE, NEAR_RATIO (`near`,
    by default _NEAR_FLOAT of the dtype) and REAL_MAX, the dtype's largest value."""
    if near is None:
        near = _NEAR_FLOAT32 if dtype == "float32" else _NEAR_FLOAT64
    return {"PLAIN_SQUARE": PLAIN_SQUARES[dtype], "NEAR_RATIO": near,
            "REAL_MAX": float(np.finfo(dtype).max)}


_SQUARES_SEARCH = ("lanes8.h", "rows8.h", "squares8.h", "plain_squares_search.h")
"""max_norm's plain search on CPUs, rows lo:hi (lo < hi) of group g eight at a time in vector
lanes (see squares8.h)."""


@wp.func_native(_c.body(*_SQUARES_SEARCH, dtype="float32",
                        constants=_squares_constants("float32")))
def _plain_squares_search(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int) -> int:
    ...


@wp.func_native(_c.body(*_SQUARES_SEARCH, dtype="float64",
                        constants=_squares_constants("float64")))
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


@wp.func_native(_c.body("plain_search.h", dtype="float32"))
def _plain_search(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_c.body("plain_search.h", dtype="float64"))
def _plain_search(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_c.body("plain_search.h", dtype="int32"))
def _plain_search(x: wp.array3d(dtype=wp.int32), lo: int, hi: int, g: int, groups: int,
                  largest: int) -> int:
    ...


@wp.func_native(_c.body("plain_search.h", dtype="int64"))
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


@wp.func_native(_c.body("lanes8.h", "rows8.h", "plain_search3.h", dtype="float32"))
def _plain_search3(x: wp.array3d(dtype=wp.float32), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_c.body("lanes8.h", "rows8.h", "plain_search3.h", dtype="float64"))
def _plain_search3(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_c.body("lanes8.h", "rows8.h", "plain_search3.h", dtype="int32"))
def _plain_search3(x: wp.array3d(dtype=wp.int32), lo: int, hi: int, largest: int) -> wp.vec3i:
    ...


@wp.func_native(_c.body("lanes8.h", "rows8.h", "plain_search3.h", dtype="int64"))
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


def _lanes_squares_source(dtype):
    """The C of max_norm's search by lanes on GPUs (lanes_squares_search.cuh) for `dtype`: its
    window 2⁻¹⁷ (float32) or 2⁻⁴⁴ (float64) wide."""
    near = 1.0 - 2.0 ** (-17 if dtype == "float32" else -44)
    return _c.body("lanes_squares_search.cuh", dtype=dtype,
                   constants=_squares_constants(dtype, near))


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


_max_ordered, _max_best, _max_first = _extreme(_value, _above, _atomic_above)
_min_ordered, _min_best, _min_first = _extreme(_value, _below, _atomic_below)
_, _max_norm_best, _max_norm_first = _extreme(_norm, _above, _atomic_above)
_NUMBERS = FLOATS + INTEGERS

# Warp's options of max_norm_lanes: at most 40 registers a thread (12 blocks of 128 an SM)
# where it took 48 (10 blocks): on an H100, flat launches, float64 113 → 105 µs at N = 10⁷,
# float32 as fast (benchmarks/RESULTS.md).
_LANES_BOUNDS = {"launch_bounds": (BLOCK_DIM, 12)}

SEARCHES = variants(
    # op, step, device, ordering, size, kernel
    # the ordered searches: on CPUs plain comparisons first (1.5–2× faster there); GPUs keep
    # the searches of _extreme for max and min (the shortcuts not measured there) and take
    # max_norm's by lanes (benchmarks/RESULTS.md)
    ("max", "ordered", "gpu", ANY, ANY, kernel("max_ordered", _max_ordered, dtypes=_NUMBERS)),
    ("max", "ordered", "cpu", ANY, ANY,
     kernel("max_cpu_ordered", _cpu_ordered_extreme(1, _value, _above), dtypes=_NUMBERS)),
    ("min", "ordered", "gpu", ANY, ANY, kernel("min_ordered", _min_ordered, dtypes=_NUMBERS)),
    ("min", "ordered", "cpu", ANY, ANY,
     kernel("min_cpu_ordered", _cpu_ordered_extreme(0, _value, _below), dtypes=_NUMBERS)),
    ("max_norm", "ordered", "gpu", ANY, ANY,
     kernel("max_norm_lanes", _max_norm_lanes_kernel, options=_LANES_BOUNDS)),
    ("max_norm", "ordered", "cpu", ANY, ANY,
     kernel("max_norm_cpu_ordered", _extreme(_norm, _above, _atomic_above, screen=_squared_norm,
                                             shortcut=_largest_square_first)[0])),
    # ids not ordered: the atomic best of the keys, then the atomic min of the rows attaining it
    ("max", "best", ANY, ANY, ANY, kernel("max_best", _max_best, dtypes=_NUMBERS)),
    ("max", "first", ANY, ANY, ANY, kernel("max_first", _max_first, dtypes=_NUMBERS)),
    ("min", "best", ANY, ANY, ANY, kernel("min_best", _min_best, dtypes=_NUMBERS)),
    ("min", "first", ANY, ANY, ANY, kernel("min_first", _min_first, dtypes=_NUMBERS)),
    ("max_norm", "best", ANY, ANY, ANY, kernel("max_norm_best", _max_norm_best)),
    ("max_norm", "first", ANY, ANY, ANY, kernel("max_norm_first", _max_norm_first)),
    # float32 on GPUs, ids not known sorted: packed keys, in any order of the ids
    ("max_norm", "packed", "gpu", ANY, ANY,
     kernel("max_norm_packed", _max_norm_packed_kernel, dtypes=("float32",))),
)
"""The searches: `ordered` (a segment's rows in order, where the ids are), else `best` and
`first` by atomics; max_norm in float32 on GPUs by `packed` keys."""
