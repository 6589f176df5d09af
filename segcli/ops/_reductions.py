"""The linear reductions: `segmented_sum`, `segmented_count`, `segmented_mean`,
`segmented_dot`, `segmented_bincount`."""


import jax.numpy as jnp

from segcli.ops import _primitives as P
from segcli.ops._common import _common, _floats, _grouped, _int32, _op, _params, _rows, _segments


@_op
def segmented_sum(x, idx, num_segments, *, indices_are_sorted=False):
    """Sum of the rows of each segment.

    Args:
      x: (N, *F) floats or integers (integers are summed in their own dtype, wrapping on
        overflow as ``jax.ops.segment_sum`` does; booleans give their `any`).
      {segment args}

    Returns:
      (M, *F) in x's dtype: out[s] = Σ_{idx[i]=s} x[i]; 0 for an empty segment.

    Example::

        segmented_sum(jnp.array([1., 2., 3.]), jnp.array([0, 0, 2]), 3)  # [3., 0., 3.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments, integers=True)
    out = P.sum_p.bind(_rows(x), *seg, **_params(m, indices_are_sorted))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_count(idx, num_segments, *, indices_are_sorted=False):
    """Rows per segment.

    Args:
      {segment args}

    Returns:
      (M,) int32: out[s] = #{i : idx[i] = s}.

    Example::

        segmented_count(jnp.array([0, 0, 2, 5]), 3)  # [2, 0, 1] (5 is out of range)
    """
    return P.count(*_segments(idx, None, num_segments), num_segments, indices_are_sorted)


@_op
def segmented_mean(x, idx, num_segments, *, indices_are_sorted=False):
    """Mean of the rows of each segment.

    Args:
      x: (N, *F) floats.
      {segment args}

    Returns:
      (M, *F): Σ_{idx[i]=s} x[i] / count, the sum divided once by the count (so [1., 6., 7.]
      gives 14/3 rounded); where that sum overflows, Σ x[i] · (1/count): finite wherever the
      mean is, up to the float max. 0 for an empty segment.

    Example::

        segmented_mean(jnp.array([1., 2., 3.]), jnp.array([0, 0, 2]), 3)  # [1.5, 0., 3.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    out = P.mean_p.bind(_rows(x), *seg, **_params(m, indices_are_sorted))
    return out.reshape(m, *x.shape[1:]).astype(dtype)


@_op
def segmented_dot(x, y, idx, num_segments, *, indices_are_sorted=False):
    """Sum over each segment of the rows' inner products, contracting all trailing axes.

    Args:
      x, y: (N, *F) floats of one shape.
      {segment args}

    Returns:
      (M,): out[s] = Σ_{idx[i]=s} <x[i], y[i]>; 0 for an empty segment.

    Example::

        x = jnp.ones((3, 3))
        segmented_dot(x, 2 * x, jnp.array([0, 0, 1]), 2)  # [12., 6.]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("as x", x.shape[0]))
    if y.shape != x.shape:
        raise ValueError(f"x and y must have the same shape, got x {x.shape} and y {y.shape}")
    y = y.astype(x.dtype)
    out = P.dot_p.bind(_grouped(x), _grouped(y), *seg, **_params(m, indices_are_sorted))
    return out[:, 0].astype(dtype)


@_op
def segmented_bincount(labels, idx, num_segments, length, *, indices_are_sorted=False):
    """How many rows of each segment carry each label (e.g. atomic numbers → composition).

    Args:
      labels: (N,) integers; labels outside [0, length) are dropped.
      {segment args}
      length: L, the number of labels, a static int.

    Returns:
      (M, L) int32: out[s, c] = #{i : idx[i] = s, labels[i] = c}. Not differentiable.

    Example::

        numbers = jnp.array([1, 1, 8, 6])  # H2O, then C
        segmented_bincount(numbers, jnp.array([0, 0, 0, 1]), 2, 119)[:, jnp.array([1, 6, 8])]
        # [[2, 0, 1], [0, 1, 0]]
    """
    if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.ndim != 1:
        raise TypeError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype "
                        f"{labels.dtype}")
    if labels.dtype not in (jnp.int32, jnp.int64):  # the kernels' two label types
        labels = _int32(labels, length)
    seg = _segments(idx, ("labels", labels.shape), num_segments)
    return P.bincount_p.bind(labels, *seg, **_params(num_segments, indices_are_sorted),
                             length=length)
