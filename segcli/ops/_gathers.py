"""Ops that gather a segment's values to its rows: `segmented_mul`, `segmented_matvec`."""



from segcli.ops import _primitives as P
from segcli.ops._common import _common, _floats, _grouped, _op, _params


@_op
def segmented_mul(x, y, idx, num_segments):
    """Each row times its segment's scalar.

    Args:
      x: (N, *F) floats.
      y: (M,) floats, one per segment.
      {segment args}

    Returns:
      (N, *F): out[i] = x[i] * y[idx[i]]; 0 for a row whose id is out of range.

    Example::

        segmented_mul(jnp.ones((3, 2)), jnp.array([2., 3.]), jnp.array([0, 1, 1]), 2)
        # [[2., 2.], [3., 3.], [3., 3.]]
    """
    x, seg, m, dtype = _common("x", x, idx, num_segments)
    y, _ = _floats("y", y, ("num_segments", m))
    if y.ndim != 1:
        raise ValueError(f"y must have shape (num_segments,) = ({m},), got {y.shape}")
    out = P.scale_p.bind(_grouped(x), y.astype(x.dtype)[:, None], *seg, **_params(m, False))
    return out.reshape(x.shape).astype(dtype)


@_op
def segmented_matvec(v, m, idx, num_segments):
    """Each row times its segment's matrix (e.g. scaled positions × cell = positions).

    Args:
      v: (N, 3) floats.
      m: (M, 3, 3) floats, one matrix per segment.
      {segment args}

    Returns:
      (N, 3): out[i] = m[idx[i]]ᵀ @ v[i]; 0 for a row whose id is out of range.

    Example::

        cell = 2 * jnp.eye(3)[None]
        segmented_matvec(jnp.array([[0.5, 0.5, 0.]]), cell, jnp.array([0]), 1)  # [[1., 1., 0.]]
    """
    v, seg, segments, dtype = _common("v", v, idx, num_segments)
    m, _ = _floats("m", m)
    if v.ndim != 2 or v.shape[1] != 3:
        raise ValueError(f"v must have shape (N, 3), got {v.shape}")
    if m.shape != (segments, 3, 3):
        raise ValueError(f"m must have shape (num_segments, 3, 3) = ({segments}, 3, 3), "
                         f"got {m.shape}")
    out = P.matvec_p.bind(v[:, None], m.astype(v.dtype)[:, None], *seg, **_params(segments, False),
                          transpose=False)
    return out[:, 0].astype(dtype)
