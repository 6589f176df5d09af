"""Gather kernels: each row given its segment's values (gather), scaled by them (scale,
scale_pair), multiplied by its segment's matrix (matvec), or given a value where a search chose
it (put).

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

Ids outside [0, M) give 0.
"""

from typing import Any

import warp as wp

from segcli.ops.kernels import _c
from segcli.ops.kernels._common import _segment_range
from segcli.ops.kernels._registry import ANY, kernel, variants


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


# The rows lo:hi of a segment, scaled, on CPUs (see scale_rows.h)
@wp.func_native(_c.body("scale_rows.h", dtype="float32"))
def _scale_rows(x: wp.array(dtype=wp.vec3f), b: wp.array(dtype=wp.vec3f),
                out: wp.array(dtype=wp.vec3f), lo: int, hi: int, factor: wp.float32,
                second: wp.float32, third: wp.float32, paired: int):
    ...


@wp.func_native(_c.body("scale_rows.h", dtype="float64"))
def _scale_rows(x: wp.array(dtype=wp.vec3d), b: wp.array(dtype=wp.vec3d),
                out: wp.array(dtype=wp.vec3d), lo: int, hi: int, factor: wp.float64,
                second: wp.float64, third: wp.float64, paired: int):
    ...


# The rows lo:hi of out set to (a, b, c) on CPUs (see fill_rows.h)
@wp.func_native(_c.body("fill_rows.h", dtype="float32"))
def _fill_rows(out: wp.array(dtype=wp.vec3f), lo: int, hi: int, a: wp.float32, b: wp.float32,
               c: wp.float32):
    ...


@wp.func_native(_c.body("fill_rows.h", dtype="float64"))
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


_VEC3 = {"y": "vec3", "out": "vec3"}
_SCALE3 = {"x": "vec3", "b": "vec3", "out": "vec3"}
_MATVEC3 = {"v": "vec3", "m": "mat33", "out": "vec3"}

GATHERS = variants(
    # op, step, device, ordering, size, kernel
    ("gather", "", "cpu", "offsets", 3,
     kernel("gather3_ordered", _gathering3(True), elements=_VEC3)),
    ("gather", "", ANY, ANY, 3, kernel("gather3", _gathering3(False), elements=_VEC3)),
    ("gather", "", ANY, ANY, ANY, kernel("gather", _gather_kernel)),
    ("scale", "", "cpu", "offsets", 3,
     kernel("scale3_ordered", _scaling3(False, True), elements=_SCALE3)),
    ("scale", "", ANY, ANY, 3, kernel("scale3", _scaling3(False, False), elements=_SCALE3)),
    ("scale", "", ANY, ANY, ANY, kernel("scale", _scaling(False))),
    ("scale_pair", "", "cpu", "offsets", 3,
     kernel("scale_pair3_ordered", _scaling3(True, True), elements=_SCALE3)),
    ("scale_pair", "", ANY, ANY, 3,
     kernel("scale_pair3", _scaling3(True, False), elements=_SCALE3)),
    ("scale_pair", "", ANY, ANY, ANY, kernel("scale_pair", _scaling(True))),
    ("matvec", "", "cpu", "offsets", 3,
     kernel("matvec3_ordered", _matvec3(True), elements=_MATVEC3)),
    ("matvec", "", ANY, ANY, 3, kernel("matvec3", _matvec3(False), elements=_MATVEC3)),
    ("matvec", "", ANY, ANY, ANY, kernel("matvec", _matvec_kernel)),
    # float64 on GPUs (XLA's scatter elsewhere): each row written once
    ("put", "", "gpu", ANY, 3,
     kernel("put3", _put3_kernel, dtypes=("float64",), elements={"ct": "vec3", "out": "vec3"})),
    ("put", "", "gpu", ANY, ANY, kernel("put", _put_kernel)),
)
"""A row a thread; rows of 3 floats as whole vectors (size 3), on CPUs given the offsets a
segment a thread, which reads each segment's factors once."""
