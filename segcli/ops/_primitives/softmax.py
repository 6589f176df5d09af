"""Each segment's largest value and sum of shifted exponentials (exp_sums), softmax and its
derivatives (softmax_tangent, softmax_curvature)."""


import jax.numpy as jnp
from jax.interpreters import ad

from segcli.ops import kernels
from segcli.ops._primitives._common import (
    _by_segment_groups,
    _empty,
    _in_rows,
    _launch_two_passes,
    _ordered_or,
    _register,
    _Rule,
    at_rows,
    custom_transposed,
)
from segcli.ops._primitives.reductions import gather_p, sum_p
from segcli.ops.kernels import (
    pick,
)


def _exp_sums(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    def found(tops, totals):  # the largest values and Σ exp(x - shift)
        return jnp.stack([jnp.where(jnp.isfinite(tops[..., 0]), tops[..., 0], 0), totals],
                         axis=-1)

    return _launch_two_passes(kernels.SOFTMAX, "exp_sums", -jnp.inf, found, x, idx,
                              offsets, num_segments, indices_are_sorted, gpu)


exp_sums_p = _register(_Rule(
    "exp_sums", _exp_sums,
    lambda x, idx, offsets, *, num_segments, **_: (num_segments, x.shape[1], 2), 1,
    batch_first=True))
"""(shift, Σ exp(x[i] - shift)) (M, K, 2) over each segment of x (N, K), shift its largest
value where finite, else 0; (0, 0) for an empty one: where the ids are ordered, both passes
in one kernel, in index order (the same bits whether the order is promised or found);
otherwise the largest values by atomic max, then the sums. No derivative rule of its own
(segcli.ops gives logsumexp and softmax theirs)."""


def _by_rows3(kernel, operands, formula, x, idx, offsets, num_segments, indices_are_sorted,
              gpu):
    """formula(), an (N, K) result of x (N, K); or on CPUs, for rows of 3 where the ids are
    ordered, kernel `kernel` over operands (x, dx; see kernels.softmax._rows3_or_zeros), the
    same bits whether the order is promised or found."""
    if gpu or x.shape[1] != 3 or _empty(x.shape, x):
        return formula()
    return _ordered_or(kernel, operands, (num_segments + 1,), x.shape, formula, idx, offsets,
                       num_segments, indices_are_sorted, gpu)


def _softmax(x, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def gathered():
        if _empty(x.shape, x):
            return jnp.zeros(x.shape, x.dtype)
        exps, totals = _exp_terms(x, idx, offsets, params)
        some = totals != 0  # (NaN stays NaN)
        return jnp.where(some, exps / jnp.where(some, totals, 1), 0)

    kernel = pick(kernels.SOFTMAX, "softmax", device="cpu", size=3)
    return _by_rows3(kernel, (x, x), gathered, x, idx, offsets, gpu=gpu, **params)


def _exp_terms(x, idx, offsets, params):
    """(exp(x[i] - shift), Σ of its segment) per row of x (N, K), each segment's shift and sum
    (exp_sums_p) taken to its rows by an XLA gather; 0 and 0 for rows whose id is out of
    range."""
    at = at_rows(exp_sums_p.bind(x, idx, offsets, **params), idx)
    return _in_rows(jnp.exp(x - at[..., 0]), idx, params["num_segments"]), at[..., 1]


softmax_p = _register(_Rule(
    "softmax", _softmax, lambda x, idx, offsets, **_: x.shape, 1, batch_first=True))
"""exp(x[i] - shift) / Σ of its segment per row of x (N, K) (see exp_sums_p), 0 where that
sum is 0 or the id out of range: on CPUs, rows of 3 with ordered ids, by one kernel
(softmax3: a thread per segment writing its rows; the same bits whether the order is
promised or found); elsewhere exp_sums_p's shifts and sums gathered to the rows by XLA. Its
JVP is softmax_tangent_p (below)."""


def _softmax_tangent(x, dx, idx, offsets, **params):
    """s (dx - Σ s dx) over each segment, s = softmax(x): softmax's tangent along dx (N, K),
    linear in dx, whose Jacobian is symmetric (its own transpose)."""
    s = softmax_p.bind(x, idx, offsets, **params)
    return s * (dx - gather_p.bind(sum_p.bind(s * dx, idx, offsets, **params), idx, offsets,
                                   **params))


def _softmax_tangent_rows(x, dx, idx, offsets, *, num_segments, indices_are_sorted, gpu=False):
    """_softmax_tangent where the ids are ordered by one kernel: on CPUs for rows of 3
    (softmax3_tangent: all in each segment's rows), on GPUs by softmax_tangent (a group of
    lanes per segment and feature, see _by_segment_groups)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def formula():
        return _softmax_tangent(x, dx, idx, offsets, **params)

    if not gpu:
        kernel = pick(kernels.SOFTMAX, "softmax", "tangent", device="cpu", size=3)
        return _by_rows3(kernel, (x, dx), formula, x, idx, offsets, gpu=gpu, **params)
    kernel = pick(kernels.SOFTMAX, "softmax", "tangent")
    return _by_segment_groups(kernel, (x, dx, dx), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, gpu=gpu, **params)


softmax_tangent_p = custom_transposed(
    "softmax_tangent", _softmax_tangent, linear=(1,), like=1,
    transpose=lambda ct, x, dx, idx, offsets, **params: [
        None, softmax_tangent_p.bind(x, ct, idx, offsets, **params), None, None],
    impl=_softmax_tangent_rows,
    moving_jvp=lambda primals, tangents, **params: softmax_curvature_p.bind(
        primals[0], primals[1], ad.instantiate_zeros(tangents[0]), *primals[2:], **params))
"""softmax's tangent map along dx (see _softmax_tangent), transposed into itself; its JVP in x
is softmax_curvature."""


def _softmax_curvature(x, a, b, idx, offsets, **params):
    """s (q - Σ s q) over each segment, q = (a - Σ s a)(b - Σ s b), s = softmax(x): softmax's
    second derivative along a and b (N, K), the JVP in x along b of its tangent along a;
    symmetric bilinear in a and b, and its own transpose in each."""
    s = softmax_p.bind(x, idx, offsets, **params)

    def centred(y):
        return y - gather_p.bind(sum_p.bind(s * y, idx, offsets, **params), idx, offsets,
                                 **params)

    return softmax_tangent_p.bind(x, centred(a) * centred(b), idx, offsets, **params)


def _softmax_curvature_rows(x, a, b, idx, offsets, *, num_segments, indices_are_sorted,
                            gpu=False):
    """_softmax_curvature, on GPUs where the ids are ordered by one kernel (softmax_curvature:
    a group of lanes per segment and feature, see _by_segment_groups)."""
    params = {"num_segments": num_segments, "indices_are_sorted": indices_are_sorted}

    def formula():
        return _softmax_curvature(x, a, b, idx, offsets, **params)

    kernel = pick(kernels.SOFTMAX, "softmax", "curvature")
    return _by_segment_groups(kernel, (x, a, b), (num_segments + 1, x.shape[1]),
                               x.shape, formula, idx, offsets, gpu=gpu, **params)


def _softmax_curvature_transpose(ct, x, a, b, idx, offsets, **params):
    if ad.is_undefined_primal(a):
        return [None, softmax_curvature_p.bind(x, ct, b, idx, offsets, **params), None, None,
                None]
    return [None, None, softmax_curvature_p.bind(x, a, ct, idx, offsets, **params), None, None]


softmax_curvature_p = custom_transposed(
    "softmax_curvature", _softmax_curvature, linear=(1, 2), like=1, multilinear=True,
    transpose=_softmax_curvature_transpose, impl=_softmax_curvature_rows)
"""softmax's second derivative along a and b (see _softmax_curvature), bilinear, transposed
into itself; its JVP in x differentiates _softmax_curvature."""


def _softmax_jvp(primals, tangents, **params):
    x, idx, offsets = primals
    return (softmax_p.bind(x, idx, offsets, **params),
            softmax_tangent_p.bind(x, ad.instantiate_zeros(tangents[0]), idx, offsets, **params))


ad.primitive_jvps[softmax_p] = _softmax_jvp
