"""`segmented_var` and `segmented_std`, with their derivatives."""

import functools

import jax
import jax.numpy as jnp

from segcli.ops import _primitives as P
from segcli.ops._common import _common, _op, _params, _rows


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _variance(rows, seg, params):
    """Σ (x[i] - mean)² / count per segment of rows (N, K): two passes, no cancellation (see
    P.moments_p)."""
    return P.moments_p.bind(rows, *seg, **dict(params))[..., 1]


@_variance.defjvp
def _variance_jvp(params, primals, tangents):
    """d var = 2 Σ (x - mean) dx / count by P.variance_tangent_p: the gradient, and each
    derivative of it, one kernel where the ids are known sorted (the variance itself unused)."""
    (rows, seg), (drows, _) = primals, tangents
    return (_variance(rows, seg, params),
            P.variance_tangent_p.bind(rows, drows, *seg, **dict(params)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _std(rows, seg, params):
    """sqrt(Σ (x[i] - mean)² / count) per segment of rows (N, K) (see P.moments_p)."""
    return jnp.sqrt(P.moments_p.bind(rows, *seg, **dict(params))[..., 1])


@_std.defjvp
def _std_jvp(params, primals, tangents):
    """d std = Σ (x - mean) dx / (count · std), 0 where std is 0, by P.std_tangent_p: its
    transpose (the gradient) and their derivatives one kernel each where the ids are known
    sorted on GPUs (the std itself unused)."""
    (rows, seg), (drows, _) = primals, tangents
    return _std(rows, seg, params), P.std_tangent_p.bind(rows, drows, *seg, **dict(params))


@_op
def segmented_var(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise population variance of each segment's rows: the mean of squared
    deviations from the segment's mean (two passes, no cancellation).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); 0 for an empty segment.

    Example::

        segmented_var(jnp.array([1., 3., 7.]), jnp.array([0, 0, 1]), 2)  # [1., 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _variance(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_std(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise population standard deviation of each segment's rows, sqrt(var).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); 0 for an empty segment. Every derivative is 0 (never NaN) where it is 0.

    Example::

        segmented_std(jnp.array([1., 3., 7.]), jnp.array([0, 0, 1]), 2)  # [1., 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _std(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)
