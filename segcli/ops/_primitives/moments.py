"""Each segment's mean and variance in two passes (moments), var's derivatives
(variance_tangent, variance_cotangent) and std's (std_tangent, std_cotangent, std_curvature)."""


import jax.numpy as jnp
from jax.interpreters import ad

from segcli.ops import kernels
from segcli.ops._primitives._common import (
    _by_segment_groups,
    _count,
    _in_rows,
    _launch_two_passes,
    _mean,
    _multilinear,
    _register,
    _Rule,
    _sum,
    at_rows,
    custom_transposed,
)
from segcli.ops._primitives.reductions import count, gather_p, mean_p, sum_p
from segcli.ops.kernels import (
    pick,
)


def _moments(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    def found(sums, squares):  # (Σ x, count) and Σ (x - mean)²
        counts = jnp.maximum(sums[..., 1], 1)
        return jnp.stack([sums[..., 0] / counts, squares / counts], axis=-1)

    return _launch_two_passes(kernels.MOMENTS, "moments", 0, found, x, idx, offsets,
                              num_segments, indices_are_sorted, gpu)


moments_p = _register(_Rule(
    "moments", _moments,
    lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1], 2), 1,
    batch_first=True))
"""(mean, Σ (x[i] - mean)² / count) (M, K, 2) over each segment of x (N, K), (0, 0) for an
empty one: where the ids are ordered, both passes of the variance in one kernel, in index
order (the same bits whether the order is promised or found); otherwise atomic sums and
counts, then the squares about their means. No derivative rule of its own (segcli.ops gives
it one)."""


def _deviations(x, idx, offsets, num_segments, indices_are_sorted, gpu):
    """(x[i] - mean of its segment, 0 in rows of no segment; 2 / count (M, 1), empty segments
    counted as 1) of x (N, K): the mean's kernel, then XLA's gather, which it fuses into the
    work that uses the rows. var's derivatives by them, not by variance_tangent's kernels, on
    CPUs: 1.6–3 times as fast there at 2 Mi rows (benchmarks/RESULTS.md)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted, "gpu": gpu}
    mean = _mean(x, idx, offsets, **params)
    counts = jnp.maximum(_count(idx, offsets, **params), 1).astype(x.dtype)[:, None]
    return _in_rows(x - at_rows(mean, idx), idx, num_segments), 2 / counts


def _variance_tangent(x, y, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    shape = (num_segments, x.shape[1])

    def formula():
        deviations, twice_inverse = _deviations(x, idx, offsets, num_segments,
                                                indices_are_sorted, gpu)
        return _sum(deviations * y, idx, offsets, num_segments=num_segments,
                    indices_are_sorted=indices_are_sorted, gpu=gpu) * twice_inverse

    kernel = pick(kernels.MOMENTS, "var", "tangent")
    return _by_segment_groups(kernel, (x, y, y), shape, shape, formula, idx,
                               offsets, num_segments, indices_are_sorted, gpu)


def _variance_cotangent(x, c, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):

    def formula():
        deviations, twice_inverse = _deviations(x, idx, offsets, num_segments,
                                                indices_are_sorted, gpu)
        return deviations * at_rows(c * twice_inverse, idx)

    kernel = pick(kernels.MOMENTS, "var", "cotangent")
    return _by_segment_groups(kernel, (x, c, c), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, num_segments,
                               indices_are_sorted, gpu)


variance_tangent_p = _multilinear(_Rule(
    "variance_tangent", _variance_tangent,
    lambda x, y, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1]), 2,
    transposes=(lambda ct, y, seg, p: variance_cotangent_p.bind(y, ct, *seg, **p),
                lambda ct, x, seg, p: variance_cotangent_p.bind(x, ct, *seg, **p))))
"""2 Σ (x[i] - mean) y[i] / count over each segment of x and y (N, K), the mean x's: var's
tangent at x along y, symmetric in x and y; 0 for an empty segment. On GPUs, where the ids
are ordered, one kernel (the mean as moments takes it, then the sum); elsewhere the mean's
kernel, XLA's fused gather and a sum (see _deviations)."""


variance_cotangent_p = _multilinear(_Rule(
    "variance_cotangent", _variance_cotangent, lambda x, c, idx, offsets, **_: x.shape, 2,
    transposes=(lambda ct, c, seg, p: variance_cotangent_p.bind(ct, c, *seg, **p),
                lambda ct, x, seg, p: variance_tangent_p.bind(x, ct, *seg, **p))))
"""(x[i] - mean) · 2 c[s] / count over the rows i of each segment s of x (N, K), for c (M, K):
var's cotangent at x (variance_tangent's transpose along y), 0 in rows of no segment. On GPUs,
where the ids are ordered, one kernel (a thread per segment and feature: the mean, then the
rows); elsewhere the mean's kernel and XLA's fused gathers (see _deviations)."""


def _std_parts(x, idx, offsets, params, fused):
    """(mean, x - mean (N, K), 0 in rows of no segment, 1 / (count · std), 1 / var) of x
    (N, K), the two scales (M, K) 0 where var is 0 (and so each of their derivatives, never
    NaN), and gather(*values): (M, K) values taken to the rows, several in one gather. The
    mean and variance by moments_p and the gathers by XLA (fused into the work that uses the
    rows) if `fused` (in an impl, where no derivative rule is needed), else by mean_p and
    gather_p (differentiable)."""
    if fused:
        def gather(*values):
            rows = at_rows(jnp.stack(values, axis=-1), idx)
            return tuple(rows[..., j] for j in range(len(values)))

        mean, var = jnp.moveaxis(moments_p.bind(x, idx, offsets, **params), -1, 0)
    else:
        def gather(*values):
            rows = gather_p.bind(jnp.concatenate(values, axis=1), idx, offsets, **params)
            return tuple(jnp.split(rows, len(values), axis=1))

        mean = mean_p.bind(x, idx, offsets, **params)
    deviations = _in_rows(x - gather(mean)[0], idx, params["num_segments"])
    if not fused:
        var = mean_p.bind(deviations * deviations, idx, offsets, **params)
    counts = jnp.maximum(count(idx, offsets, **params), 1).astype(x.dtype)[:, None]
    zero = var == 0
    var = jnp.where(zero, 1, var)
    return (mean, deviations, jnp.where(zero, 0, 1 / (counts * jnp.sqrt(var))),
            jnp.where(zero, 0, 1 / var), gather)


def _std_tangent(x, y, idx, offsets, fused=False, **params):
    """Σ (x[i] - mean) y[i] / (count · std) over each segment of x and y (N, K): std's tangent
    at x along y (M, K), linear in y; 0 where std is 0."""
    _, deviations, scale, _, _ = _std_parts(x, idx, offsets, params, fused)
    return sum_p.bind(deviations * y, idx, offsets, **params) * scale


def _std_cotangent(x, c, idx, offsets, fused=False, **params):
    """(x[i] - mean) c[s] / (count · std) over the rows i of each segment s of x (N, K), for c
    (M, K): std's cotangent at x, _std_tangent's transpose along y; 0 where std is 0 and in rows
    of no segment. The mean is gathered with its weight, in one gather (faster on CPUs than
    the deviations' own gather and a second)."""
    mean, _, scale, _, gather = _std_parts(x, idx, offsets, params, fused)
    centre, weight = gather(mean, scale * c)
    return _in_rows((x - centre) * weight, idx, params["num_segments"])


def _std_curvature(x, a, c, idx, offsets, fused=False, **params):
    """c[s] ((a[i] - mean a) - d[i] Σ d a / (count · var)) / (count · std) over the rows i of
    each segment s, d = x - mean: std's second derivative along a weighted by c (N, K), the
    JVP in x along a of _std_cotangent; bilinear, and its own transpose in a (a Hessian); 0
    where std is 0 and in rows of no segment."""
    _, deviations, scale, inverse_var, gather = _std_parts(x, idx, offsets, params, fused)
    k = x.shape[1]
    means = mean_p.bind(jnp.concatenate([a, deviations * a], axis=1), idx, offsets, **params)
    weight, mean_a, ratio = gather(scale * c, means[:, :k], means[:, k:] * inverse_var)
    return _in_rows(weight * (a - mean_a - deviations * ratio), idx, params["num_segments"])


def _std_impl(kernel, formula, rows):
    """The impl of formula (x, a[, b]): on GPUs, where the ids are ordered, kernel `kernel` (a
    group of lanes per segment and feature: the mean, the variance, then the sum or the rows;
    see _by_segment_groups), into x's shape if `rows` else (M, K); elsewhere formula's
    moments_p and XLA's fused gathers."""

    def impl(x, *operands, num_segments, indices_are_sorted, gpu=False):
        *floats, idx, offsets = operands
        params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}
        shape = x.shape if rows else (num_segments, x.shape[1])
        return _by_segment_groups(
            kernel, (x, floats[0], floats[-1]), (num_segments + rows, x.shape[1]), shape,
            lambda: formula(x, *floats, idx, offsets, fused=True, **params), idx, offsets,
            gpu=gpu, **params)

    return impl


std_tangent_p = custom_transposed(
    "std_tangent", _std_tangent, linear=(1,),
    like=lambda x, y, idx, offsets, *, num_segments, **_: x.update(shape=(num_segments,
                                                                           x.shape[1])),
    transpose=lambda ct, x, y, idx, offsets, **params: [
        None, std_cotangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_std_impl(pick(kernels.MOMENTS, "std", "tangent"), _std_tangent, rows=False))
"""std's tangent map along y (see _std_tangent), transposed into std_cotangent; its JVP in x
differentiates _std_tangent."""


std_cotangent_p = custom_transposed(
    "std_cotangent", _std_cotangent, linear=(1,), like=0,
    transpose=lambda ct, x, c, idx, offsets, **params: [
        None, std_tangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_std_impl(pick(kernels.MOMENTS, "std", "cotangent"), _std_cotangent, rows=True),
    moving_jvp=lambda primals, tangents, **params: std_curvature_p.bind(
        primals[0], ad.instantiate_zeros(tangents[0]), *primals[1:], **params))
"""std's cotangent at x (see _std_cotangent), transposed into std_tangent; its JVP in x is
std_curvature."""


def _std_curvature_transpose(ct, x, a, c, idx, offsets, **params):
    if ad.is_undefined_primal(a):
        return [None, std_curvature_p.bind(x, ct, c, idx, offsets, **params), None, None, None]
    ones = jnp.ones(c.aval.shape, c.aval.dtype)  # linear in c: c[s] times its weight-1 rows
    return [None, None, sum_p.bind(ct * std_curvature_p.bind(x, a, ones, idx, offsets, **params),
                                   idx, offsets, **params), None, None]


std_curvature_p = custom_transposed(
    "std_curvature", _std_curvature, linear=(1, 2), like=0, multilinear=True,
    transpose=_std_curvature_transpose,
    impl=_std_impl(pick(kernels.MOMENTS, "std", "curvature"), _std_curvature, rows=True))
"""std's weighted second derivative (see _std_curvature), bilinear; its JVP in x
differentiates _std_curvature."""
