"""The linear reductions (sum, mean, dot, outer, count, bincount) and the gathers that are their
transposes (gather, scale, rescale, rescale2, scaled_dot, matvec), each with its rules."""


import jax.numpy as jnp

from segcli.ops import kernels
from segcli.ops._primitives._common import (
    _count,
    _empty,
    _integral,
    _is_float_vec3,
    _layout,
    _mean,
    _multilinear,
    _reduce,
    _rows3,
    _Rule,
    _segments,
    _sum,
    at_rows,
    ids_known_sorted,
)
from segcli.ops.kernels import (
    BINCOUNT_LANES,
    lane_grid,
    launch,
    pick,
    stride,
)

# The lambdas of the table of transposes refer to primitives defined further down.
sum_p = _multilinear(_Rule(
    "sum", _sum, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 1,
    transposes=(lambda ct, seg, p: gather_p.bind(ct, *seg, **p),)))


XLA_GATHER_ROWS = 1 << 20
"""Rows up to which gather_p of float64 is XLA's gather on GPUs (float32: at any size), which
XLA fuses into the work that uses the rows. On an H100 at N = 10⁷, float32: the gradients of
var, std, logsumexp and softmax 1.2–1.6 times as fast (var 390 → 243 µs), their second
orders 1.3–2 times, sum's as fast, mean's slower (81 → 96 µs: its gather alone); float64
gathered alone (grad sum) took twice the kernel's time (118 → 236 µs), so from 2²⁰ rows on
float64 is the kernel's (benchmarks/RESULTS.md)."""


def _gather(y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (idx.shape[0], y.shape[1])
    if _empty(shape, y):
        return jnp.zeros(shape, y.dtype)
    if gpu and (y.dtype != jnp.float64 or idx.shape[0] < XLA_GATHER_ROWS):
        return at_rows(y, idx)  # fused into the work that uses the rows
    if _is_float_vec3(y):
        return _rows3("gather", y, idx, offsets, idx=idx, offsets=offsets,
                      segments=y.shape[0], gpu=gpu).reshape(shape)
    return launch(pick(kernels.GATHERS, "gather"), y, idx, dims=(idx.shape[0],), out=shape)


mean_p = _multilinear(_Rule(
    "mean", _mean, lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 1,
    transposes=(lambda ct, seg, p: gather_p.bind(
        ct / jnp.maximum(count(*seg, **p), 1).astype(ct.dtype)[:, None], *seg, **p),)))
"""Σ x[i] / count over each segment of x (N, K): the sum divided by the count (rounded once),
or where that sum is not finite Σ x[i] · (1/count) (no partial sum exceeds the largest
|x[i]|); 0 for an empty segment."""


gather_p = _multilinear(_Rule(
    "gather", _gather, lambda y, idx, offsets, **_: (idx.shape[0], y.shape[1]), 1,
    transposes=(lambda ct, seg, p: sum_p.bind(ct, *seg, **p),)))


def _dot(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False, w=None):
    shape = (num_segments, x.shape[1])
    if _empty(shape, x, y):
        return jnp.zeros(shape, x.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    # the rows' products summed by lanes per segment (ordered ids), else by atomics
    factors = jnp.zeros((0, x.shape[1]), x.dtype) if w is None else w
    lanes, dims = lane_grid(shape[0] * shape[1], gpu)
    kernel = pick(kernels.REDUCTIONS, "dot", "span")
    out = launch(kernel, x, x.reshape(-1), y.reshape(-1), factors, *layout, lanes,
                 dims=dims, out=shape)
    if known_sorted:
        return out
    threads = stride(gpu, idx.shape[0])
    kernel = pick(kernels.REDUCTIONS, "dot", "atomic")
    return launch(kernel, x, y, factors, idx, layout[1], threads, out,
                  dims=(threads, shape[1]), in_out=("out",))


dot_p = _multilinear(_Rule(
    "dot", _dot, lambda x, y, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 2,
    transposes=(lambda ct, y, seg, p: scale_p.bind(y, ct, *seg, **p),
                lambda ct, x, seg, p: scale_p.bind(x, ct, *seg, **p))))


def _scale(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    return _rescale(x, y, jnp.zeros((0, *y.shape[1:]), y.dtype), idx, offsets, gpu=gpu)


def _rescale(x, y, z, idx, offsets, *, gpu=False, **_):
    return _scaled_rows("scale", x, y, z, x[:0], y[:0], idx, offsets, gpu)


def _rescale2(x, b, y, z, w, idx, offsets, *, gpu=False, **_):
    return _scaled_rows("scale_pair", x, y, z, b, w, idx, offsets, gpu)


def _scaled_rows(op, x, y, z, b, w, idx, offsets, gpu):
    """x[i] · y[s] · z[s] (z empty: 1) by GATHERS' "scale", or that + b[i] · y[s] · w[s] by
    "scale_pair" (each as its vec3 variant for rows of 3 floats, see _rows3)."""
    if _empty(x.shape, x, y):
        return jnp.zeros(x.shape, x.dtype)
    if _is_float_vec3(x):
        def vec3(a):
            return a.reshape(a.shape[0], 3)

        return _rows3(op, vec3(x), y, z, vec3(b), w, idx, offsets, idx=idx,
                      offsets=offsets, segments=y.shape[0], gpu=gpu).reshape(x.shape)
    kernel = pick(kernels.GATHERS, op)
    return launch(kernel, x, y, z, b, w, idx, dims=(idx.shape[0],), out=x.shape)


scale_p = _multilinear(_Rule(
    "scale", _scale, lambda x, y, idx, offsets, **_: x.shape, 2,
    transposes=(lambda ct, y, seg, p: scale_p.bind(ct, y, *seg, **p),
                lambda ct, x, seg, p: dot_p.bind(ct, x, *seg, **p))))


rescale_p = _multilinear(_Rule(
    "rescale", _rescale, lambda x, y, z, idx, offsets, **_: x.shape, 3,
    transposes=(lambda ct, y, z, seg, p: rescale_p.bind(ct, y, z, *seg, **p),
                lambda ct, x, z, seg, p: scaled_dot_p.bind(x, ct, z, *seg, **p),
                lambda ct, x, y, seg, p: scaled_dot_p.bind(x, ct, y, *seg, **p))))
"""(x[i] · y[s]) · z[s] over the rows i of each segment s, by one kernel: x scaled by two
factors of its segment, such as a power of two near 1/|x| and a cotangent, whose product
alone could underflow where this does not."""


rescale2_p = _multilinear(_Rule(
    "rescale2", _rescale2, lambda x, b, y, z, w, idx, offsets, **_: x.shape, 5,
    slots=((0, 1), (2,), (3, 4)),
    transposes=(lambda ct, b, y, z, w, seg, p: rescale_p.bind(ct, y, z, *seg, **p),
                lambda ct, x, y, z, w, seg, p: rescale_p.bind(ct, y, w, *seg, **p),
                lambda ct, x, b, z, w, seg, p: (scaled_dot_p.bind(x, ct, z, *seg, **p)
                                                + scaled_dot_p.bind(b, ct, w, *seg, **p)),
                lambda ct, x, b, y, w, seg, p: scaled_dot_p.bind(x, ct, y, *seg, **p),
                lambda ct, x, b, y, z, seg, p: scaled_dot_p.bind(b, ct, y, *seg, **p))))
"""(x[i] · y[s]) · z[s] + (b[i] · y[s]) · w[s]: two rescales of a segment's rows that share a
factor, added by the one kernel (a sum of two products: linear in (x, b), in y and in (z, w))."""


def _scaled_dot(x, y, w, idx, offsets, **params):
    return _dot(x, y, idx, offsets, w=w, **params)


scaled_dot_p = _multilinear(_Rule(
    "scaled_dot", _scaled_dot,
    lambda x, y, w, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 3,
    transposes=(lambda ct, y, w, seg, p: rescale_p.bind(y, w, ct, *seg, **p),
                lambda ct, x, w, seg, p: rescale_p.bind(x, w, ct, *seg, **p),
                lambda ct, x, y, seg, p: ct * dot_p.bind(x, y, *seg, **p))))
"""Σ <x[i] · w[s], y[i]> over each segment s (x, y (N, G, K), w (M, G)): a dot of rows scaled
per segment, such as by a power of two near 1/|x| so that nothing overflows. Its transpose for
x or y is one rescale kernel, where that of a dot of scaled rows would scale them first."""


def _matvec(v, m, idx, offsets, *, num_segments, indices_are_sorted, transpose, gpu=False):
    if _empty(v.shape, v, m):
        return jnp.zeros(v.shape, v.dtype)
    if _is_float_vec3(v) and m.shape[1:] == (1, 3, 3):
        return _rows3("matvec", v.reshape(-1, 3), m.reshape(-1, 3, 3), idx, offsets,
                      int(transpose), idx=idx, offsets=offsets, segments=m.shape[0],
                      gpu=gpu).reshape(v.shape)
    kernel = pick(kernels.GATHERS, "matvec")
    return launch(kernel, v, m, idx, int(transpose), dims=(idx.shape[0],), out=v.shape)


matvec_p = _multilinear(_Rule(
    "matvec", _matvec, lambda v, m, idx, offsets, **_: v.shape, 2,  # square matrices
    transposes=(
        lambda ct, m, seg, p: matvec_p.bind(ct, m, *seg, **{**p, "transpose": not p["transpose"]}),
        lambda ct, v, seg, p: outer_p.bind(*((ct, v) if p["transpose"] else (v, ct)), *seg,
                                           **_segments(p)))))


def _outer(a, b, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    (n, groups, k), l = a.shape, b.shape[2]  # noqa: E741  (a is (N, G, K), b is (N, G, L))
    shape = (num_segments, groups, k, l)
    if _empty(shape, a, b):
        return jnp.zeros(shape, a.dtype)
    layout = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    kernel = pick(kernels.REDUCTIONS, "outer")
    out = _reduce(kernel, a.reshape(n, groups * k), b.reshape(n, groups * l), idx, layout,
                  (num_segments, groups * k * l), a.dtype, gpu,
                  ids_known_sorted(offsets, indices_are_sorted))
    return out.reshape(shape)


outer_p = _multilinear(_Rule(
    "outer", _outer,
    lambda a, b, idx, offsets, *, num_segments, **_: (num_segments, *a.shape[1:], b.shape[2]), 2,
    transposes=(lambda ct, b, seg, p: matvec_p.bind(b, ct, *seg, **p, transpose=True),
                lambda ct, a, seg, p: matvec_p.bind(a, ct, *seg, **p, transpose=False))))


count_p = _integral(_Rule("count", _count,
                          lambda idx, offsets, *, num_segments, **_: (num_segments,),
                          dtype=jnp.int32))


def count(idx, offsets, num_segments, indices_are_sorted):
    """Ids per segment, int32 (not differentiable)."""
    return count_p.bind(idx, offsets, num_segments=num_segments,
                        indices_are_sorted=bool(indices_are_sorted))


def _bincount(labels, idx, offsets, *, num_segments, indices_are_sorted, length, gpu=False):
    shape = (num_segments, length)
    if _empty(shape, labels):
        return jnp.zeros(shape, jnp.int32)
    known_sorted = ids_known_sorted(offsets, indices_are_sorted)
    offsets, ordered = _layout(idx, offsets, num_segments, indices_are_sorted, gpu)
    # on GPUs a warp per segment zeroes its row and adds its rows; with one lane (CPUs) a
    # thread per segment adds them into zeros (faster there than zeroing its row)
    lanes, dims = lane_grid(num_segments, gpu, BINCOUNT_LANES)
    args = (pick(kernels.REDUCTIONS, "bincount"), labels, offsets, ordered, lanes)
    out = (launch(*args, dims=dims, out=shape, dtype=labels.dtype) if lanes > 1 else
           launch(*args, jnp.zeros(shape, jnp.int32), dims=dims, in_out=("out",),
                  dtype=labels.dtype))
    if known_sorted:
        return out
    threads = stride(gpu, idx.shape[0])
    kernel = pick(kernels.REDUCTIONS, "bincount", "atomic")
    return launch(kernel, labels, idx, ordered, threads, out, dims=(threads,),
                  in_out=("out",), dtype=labels.dtype)


bincount_p = _integral(_Rule(
    "bincount", _bincount,
    lambda labels, idx, offsets, *, num_segments, length, **_: (num_segments, length),
    dtype=jnp.int32))
"""Rows per segment with each label in [0, length) of int32 or int64 labels (N,): (M, length)
int32."""
