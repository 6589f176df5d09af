"""`segmented_logsumexp` and `segmented_softmax`, with their derivatives."""

import functools

import jax
import jax.numpy as jnp

from segcli.ops import _primitives as P
from segcli.ops._common import _common, _op, _params, _rows


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _logsumexp(rows, seg, params):
    """log Σ exp x[i] per segment of rows (N, K): its shift plus the log of its sum (see
    P.exp_sums_p); -inf where the sum is 0."""
    out = P.exp_sums_p.bind(rows, *seg, **dict(params))
    none = out[..., 1] == 0
    return jnp.where(none, -jnp.inf, jnp.log(jnp.where(none, 1, out[..., 1]))) + out[..., 0]


@_logsumexp.defjvp
def _logsumexp_jvp(params, primals, tangents):
    """d lse = Σ softmax(x)[i] dx[i]: 0 (not NaN) where lse is -inf."""
    (rows, seg), (drows, _) = primals, tangents
    return (_logsumexp(rows, seg, params),
            P.sum_p.bind(_softmax(rows, seg, params) * drows, *seg, **dict(params)))


def _softmax(rows, seg, params):
    """exp(x[i] - shift) / Σ of its segment per row of rows (N, K); 0 where that sum is 0 or
    the id out of range (P.softmax_p, whose JVP is P.softmax_tangent_p)."""
    return P.softmax_p.bind(rows, *seg, **dict(params))


@_op
def segmented_logsumexp(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise log Σ exp x[i] over each segment, shifted by the segment's max: no
    overflow up to the float max.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F); -inf for an empty segment. Its gradient is `segmented_softmax`.

    Example::

        segmented_logsumexp(jnp.array([1000., 1000., 0.]), jnp.array([0, 0, 1]), 2)
        # [1000.6931, 0.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _logsumexp(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_softmax(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise softmax within each segment, shifted by the segment's max (stable).

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (N, *F): exp(x[i]) / Σ_{idx[j]=idx[i]} exp(x[j]); 0 for a row whose id is out of range
      and in a segment whose entries are all -inf.

    Example::

        segmented_softmax(jnp.array([0., 0., 5.]), jnp.array([0, 0, 1]), 2)  # [0.5, 0.5, 1.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = _softmax(_rows(x), seg, tuple(_params(m, indices_are_sorted).items()))
    return out.reshape(x.shape).astype(dtype)
