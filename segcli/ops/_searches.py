"""`segmented_max` and `segmented_min`, through the first row attaining each."""


import jax
import jax.numpy as jnp
import numpy as np

from segcli.ops import _primitives as P
from segcli.ops._common import _common, _op, _params, _rows


def _lowest(dtype, kind):
    """The value of an empty segment's max (kind "max") or min: ∓inf, the integer bound, or
    for booleans (reduced as 0 and 1) False and True, as 0 and 1."""
    if dtype == jnp.bool_:
        return int(kind == "min")
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return -jnp.inf if kind == "max" else jnp.inf


def _extreme_values(kind, rows, seg, params, dtype):
    """Each segment's max or min (`kind`) of each column of rows (N, K): the entries the
    search chose, so that the derivative flows to them; for an empty segment _lowest of
    `dtype` (the caller's, which rows may widen)."""
    first = P.extreme_p.bind(rows[:, :, None], *seg, kind=kind, **params)
    taken = P.take_p.bind(rows[:, :, None], first, *seg, **params)[..., 0]
    return jnp.where(first == rows.shape[0], _lowest(dtype, kind), taken)


_SIGN_BIT = np.uint32(2**31)


def _extreme(kind, x, idx, num_segments, indices_are_sorted):
    if x.dtype == jnp.uint32:  # ordered as int32 with the sign bit flipped (no int64 needed)
        flipped = jax.lax.bitcast_convert_type(x ^ _SIGN_BIT, jnp.int32)
        out = _extreme(kind, flipped, idx, num_segments, indices_are_sorted)
        return jax.lax.bitcast_convert_type(out, jnp.uint32) ^ _SIGN_BIT
    x, seg, m, dtype = _common("x", x, idx, num_segments, integers=True)
    out = _extreme_values(kind, _rows(x), seg, _params(m, indices_are_sorted), dtype)
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_max(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise max of each segment's rows.

    Args:
      x: (N, *F) floats or integers (reduced in their own dtype).
      {segment args}

    Returns:
      (M, *F) in x's dtype; -inf (integers: their smallest value; booleans: False) for an
      empty segment, as ``jax.ops.segment_max``; NaN where a segment's component holds one.
      The derivative of each component flows to the first row (in row order) attaining it,
      so ties split nothing.

    Example::

        segmented_max(jnp.array([1., 5., 5., 2.]), jnp.array([0, 0, 0, 2]), 3)  # [5., -inf, 2.]
    """
    return _extreme("max", x, idx, num_segments, indices_are_sorted)


@_op
def segmented_min(x, idx, num_segments, *, indices_are_sorted=False):
    """Componentwise min of each segment's rows.

    Args:
      x: (N, *F) floats or integers (reduced in their own dtype).
      {segment args}

    Returns:
      (M, *F) in x's dtype; +inf (integers: their largest value; booleans: True) for an
      empty segment, as ``jax.ops.segment_min``; NaN where a segment's component holds one.
      The derivative of each component flows to the first row attaining it.

    Example::

        segmented_min(jnp.array([1., 5., 1., 2.]), jnp.array([0, 0, 0, 2]), 3)  # [1., inf, 2.]
    """
    return _extreme("min", x, idx, num_segments, indices_are_sorted)
